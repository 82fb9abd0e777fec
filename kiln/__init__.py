"""Kiln: serve and learn in one JAX process."""

from kiln.host_allocator import keep_step_temporaries_on_the_heap
from kiln.xla_flags import add_process_flags

__version__ = "0.1.0"

add_process_flags()
keep_step_temporaries_on_the_heap()
