"""Benchmarks: one module per figure, run as ``python -m benchmarks.NAME`` (see README.md here)."""
