"""Prepares a run of the GPU benchmarks on a lent GPU machine (run.sh beside this), here, where the
registries are reachable: into the ignored folder .gpu/ of the repository it puts

- wheels/: Kiln's runtime packages for CPython 3.12 that the GPU machine's image lacks (it has JAX
  with CUDA, PyTorch, transformers, Flax, Optax, orbax, tokenizers and the common libraries, and no
  network);
- model/: the default model's config.json and tokenizer files. Its weights exceed the transfer
  limit, so run.sh gives the model random weights of the same shape (bench/random_model.py): the
  benches measure speed.

    python bench/gpu/prepare.py        # then carry .gpu and run bench/gpu/run.sh there
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kiln.models.loader import convert_gguf, default_model_path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / ".gpu"
# What Kiln imports to serve and train that the image does not hold (graders' and the router's
# extras are imported lazily and are not needed by the benches).
PACKAGES = ["sniffio", "litestar", "msgspec", "uvicorn", "gguf", "pyzmq", "llguidance", "jsonschema", "pydantic",
            "openai"]
# The image's own copies win: their wheels are dropped after pip resolves the packages above.
IMAGE_HAS = {"anyio", "attrs", "certifi", "charset_normalizer", "click", "h11", "httpcore", "httpx", "idna",
             "markdown_it_py", "mdurl", "multidict", "numpy", "pygments", "pyyaml", "requests", "rich",
             "tqdm", "typing_extensions", "urllib3", "packaging", "jinja2", "markupsafe"}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 26, 17)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def main() -> None:
    wheels, model = GPU / "wheels", GPU / "model"
    shutil.rmtree(GPU, ignore_errors=True)
    wheels.mkdir(parents=True), model.mkdir()
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    if "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(wheels),
                    *PACKAGES], check=True)
    for w in wheels.glob("*.whl"):
        if w.name.split("-")[0].lower() in IMAGE_HAS:
            w.unlink()
    src, _ = convert_gguf(default_model_path(), show_progress=False)
    for f in Path(src).iterdir():
        if f.name == "config.json" or f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(f, model / f.name)
    size = sum(f.stat().st_size for f in GPU.rglob("*") if f.is_file())
    print(f"{GPU}: {len(list(wheels.glob('*.whl')))} wheels, {len(list(model.iterdir()))} model files, "
          f"{size / 2**20:.1f} MiB to carry")


if __name__ == "__main__":
    main()
