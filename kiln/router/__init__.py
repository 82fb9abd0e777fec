"""Kiln's router: a separate process that routes requests among many Kiln workers.

It loads no model: nothing here imports the engine, the models, the server or JAX.
"""
