"""INT4 weights: one packed representation (weights.py), the kernels that multiply by it (linear.py), and the
loaders that fill it from quantized checkpoints without a float copy of the quantized tensors (gguf.py)."""
