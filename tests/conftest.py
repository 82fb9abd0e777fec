import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import pytest  # noqa: E402

from kiln.models.decoder import forward  # noqa: E402

# one compiled forward per (shapes, config) for the whole session
jit_forward = jax.jit(forward, static_argnames=("cfg", "unroll"))


@pytest.fixture(scope="session")
def kiln_cache(tmp_path_factory):
    """A Kiln cache dir private to this test session (converted GGUFs land here)."""
    path = tmp_path_factory.mktemp("kiln-cache")
    old = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("KILN_CACHE_DIR", None)
    else:
        os.environ["KILN_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, kiln_cache):
    """A tiny random llama with a byte-level tokenizer and chat template, loaded from GGUF."""
    from tiny_models import make_hf_model, write_gguf

    from kiln.models.loader import load_model

    path = write_gguf(make_hf_model("llama", vocab_size=260, seed=3), tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return load_model(path, show_progress=False, model_id="tiny-llama")


@pytest.fixture(scope="session")
def expressive_model(tmp_path_factory, kiln_cache):
    """The tiny llama with larger initial weights: at the default init its logits cannot
    exceed about +-1.3, so no adapter could make a reply likely."""
    from tiny_models import make_hf_model, write_gguf

    from kiln.models.loader import load_model

    hf = make_hf_model("llama", vocab_size=260, seed=3, initializer_range=0.25)
    return load_model(write_gguf(hf, tmp_path_factory.mktemp("expressive") / "tiny.gguf"), show_progress=False,
                      model_id="tiny-llama")
