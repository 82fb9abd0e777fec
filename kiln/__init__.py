"""Kiln: serve and learn in one JAX process."""

from kiln.xla_flags import add_process_flags

__version__ = "0.1.0"

add_process_flags()
