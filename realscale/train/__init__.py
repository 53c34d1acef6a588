"""The Megatron training engine: build on a mesh, log-probs, train step, checkpoints."""
