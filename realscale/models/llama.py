"""Llama (2, 3, 3.1 RoPE scaling) and Llama-architecture models such as SmolLM2."""

from realscale.models.registry import Family, register

LLAMA = register(Family(name="llama", model_types=("llama",)))
