"""Model files from outside Hugging Face, in plain PyTorch, each a complete model.py of the
README's contract (read as text by :func:`benchmarks.zoo.family.external`)."""
