"""Kiln: serve and learn in one JAX process."""

__version__ = "0.1.0"
