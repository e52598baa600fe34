"""The held-out zoo: architectures the test suite does not use, compiled and verified as a
new user would (``python -m benchmarks.zoo``; README.md here)."""
