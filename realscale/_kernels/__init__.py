"""Compiled kernels built from ``csrc/`` by setup.py land in this package.

Import them through :func:`realscale.kernels.load`, never directly: that function
returns ``None`` when a kernel is not built, so callers take their Python fallback.
"""
