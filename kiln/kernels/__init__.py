"""Kiln's own kernels, where XLA's programs leave speed on the table (see cpu.py)."""
