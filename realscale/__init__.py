"""realscale: fully asynchronous RL for large reasoning models on Megatron-core.

The package imports nothing heavy at the top level; torch and megatron are imported by
the modules that need them. Importing it installs one import hook: megatron-core's
fusions compile on their first call rather than at import (megatron_patches.lazy_jit),
which keeps TorchDynamo and Inductor out of every process that never runs one.
"""

try:
    from megatron_patches.lazy_jit import install as _defer_megatron_compile
except ImportError:  # the realscale package copied alone (the code sandbox's unprivileged user
    pass  # gets such a copy): no megatron there to defer; megatron_state still needs megatron_patches
else:
    _defer_megatron_compile()

__version__ = "0.1.0"
