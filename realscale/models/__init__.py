"""Model families realscale knows (Qwen2, Qwen3, Llama) and locally built tiny models."""
