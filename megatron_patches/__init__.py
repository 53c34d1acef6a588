"""What megatron-core needs to run on CPU/gloo, and any fixes we carry.

- :mod:`megatron_patches.cpu`: ``apply()`` makes megatron-core's CUDA-only call sites
  work on the CPU with gloo (opt-in, idempotent, only when CUDA is absent or forced).
"""
