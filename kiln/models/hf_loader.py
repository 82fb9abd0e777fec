"""Loads HF model directories: config.json, single or sharded *.safetensors, generation_config.json."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig
from kiln.models.weights import build_params


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError("file not found", file=str(path)) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"invalid JSON: {exc}", file=str(path)) from exc


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or from the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError("index has no weight_map", file=str(index))
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError("no *.safetensors weights in model directory", file=str(model_dir))
    mapping: dict[str, Path] = {}
    for f in files:
        for name in _open(f).keys():
            mapping[name] = f
    return mapping


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except FileNotFoundError as exc:
        raise ModelLoadError("weights file not found", file=str(path)) from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"corrupt safetensors file: {exc}", file=str(path)) from exc


def load_hf_dir(model_dir: str | Path, dtype, show_progress: bool = True,
                label: str | None = None, supplied: Collection[str] = ()) -> tuple[ModelConfig, dict, dict]:
    """Returns (config, numpy params, generation_config); the params named in `supplied` are left
    out, unread (see `build_params`)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    cfg = ModelConfig.from_hf(read_json(config_path), source=str(config_path))
    files = weight_files(model_dir)
    handles: dict[Path, object] = {}

    def read(name: str) -> np.ndarray:
        path = files[name]
        if path not in handles:
            handles[path] = _open(path)
        try:
            return handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot read tensor: {exc}", file=str(path), tensor=name) from exc

    def source(name: str) -> str:
        return str(files.get(name, model_dir))

    with tqdm(total=len(files), desc=f"loading {label or model_dir.name}", unit="tensor", disable=not show_progress,
              leave=False) as bar:
        params = build_params(cfg, sorted(files), read, source, dtype, progress=bar.update, supplied=supplied)
    gen_path = model_dir / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else {}
    return cfg, params, generation
