"""Errors raised while loading a model: each names the file and, where known, the tensor."""

from __future__ import annotations


class ModelLoadError(Exception):
    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = []
        if file:
            where.append(f"file {file}")
        if tensor:
            where.append(f"tensor {tensor}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
