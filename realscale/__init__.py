"""realscale: fully asynchronous RL for large reasoning models on Megatron-core.

The package imports nothing heavy at the top level; torch and megatron are imported by
the modules that need them.
"""

__version__ = "0.1.0"
