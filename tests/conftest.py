import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from server_process import compile_fast  # noqa: E402

compile_fast()  # before JAX starts its backend (server_process says why)

import jax  # noqa: E402
import pytest  # noqa: E402

from kiln.models.decoder import forward  # noqa: E402

# one compiled forward per (shapes, config) for the whole session
jit_forward = jax.jit(forward, static_argnames=("cfg", "unroll"))


_MAPS = "/proc/self/maps"
# XLA:CPU keeps each live executable's code in memory maps of its own, hundreds for a large one, and
# the jit caches keep every executable the suite compiled: past the kernel's vm.max_map_count (65,530
# by default) a compile's mmap fails and XLA crashes. After a module that leaves this process above
# this many maps, the caches are dropped (later modules recompile or reload what they need).
_MAPS_BEFORE_CLEARING = 24_000
_maps = {"peak": 0, "at": "", "clears": 0}


def _memory_maps() -> int:
    with open(_MAPS) as maps:
        return sum(1 for _ in maps)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if not os.path.exists(_MAPS) or (nextitem is not None and nextitem.module is item.module):
        return
    n = _memory_maps()
    if n > _maps["peak"]:
        _maps.update(peak=n, at=item.module.__name__)
    if n > _MAPS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()
        _maps["clears"] += 1


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core, at most 4 and one per 8 GiB of memory (a worker holds models and
    the servers it starts). Not in CI: on two cores it gained nothing (see README)."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(len(os.sched_getaffinity(0)), 4, int(memory_gib // 8)))


def pytest_terminal_summary(terminalreporter):
    if _maps["peak"]:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = f.read().strip()
        terminalreporter.write_line(f"peak memory maps: {_maps['peak']} (after {_maps['at']}; vm.max_map_count "
                                    f"{limit}; jit caches cleared {_maps['clears']} times)")


@pytest.fixture(scope="session")
def kiln_cache(tmp_path_factory):
    """A Kiln cache dir private to this test session (converted GGUFs land here). JAX's persistent
    compilation cache sits where servers started on it look (<cache>/jax), so a step bucket one
    engine compiled loads in every later engine and server of the session instead of compiling again."""
    from kiln.engine.setup import configure_compilation_cache

    path = tmp_path_factory.mktemp("kiln-cache")
    configure_compilation_cache(path / "jax")
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
def tiny_server(tiny_model, kiln_cache):
    """One server of the tiny model, served as "tiny-llama" with the suite's settings, shared by every
    module whose tests only read from a server (requests, graders, renders)."""
    from server_process import ServerProcess

    # agent runs may start the test MCP server on stdio, and a command that does not exist
    mcp = f"{sys.executable} {Path(__file__).parent / 'mcp_server.py'} stdio,/nonexistent/mcp-server"
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME="tiny-llama",
                        KILN_SERVER_MCP_COMMANDS=mcp)
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="session")
def expressive_model(tmp_path_factory, kiln_cache):
    """The tiny llama with larger initial weights: at the default init its logits cannot
    exceed about +-1.3, so no adapter could make a reply likely."""
    from tiny_models import make_hf_model, write_gguf

    from kiln.models.loader import load_model

    hf = make_hf_model("llama", vocab_size=260, seed=3, initializer_range=0.25)
    return load_model(write_gguf(hf, tmp_path_factory.mktemp("expressive") / "tiny.gguf"), show_progress=False,
                      model_id="tiny-llama")


@pytest.fixture(scope="session")
def other_tokenizer_gguf(tmp_path_factory, kiln_cache):
    """A tiny llama GGUF whose tokenizer differs from the tiny models' (other special tokens)."""
    import tiny_models

    specials = tiny_models.SPECIALS
    tiny_models.SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    try:
        hf = tiny_models.make_hf_model("llama", vocab_size=260, seed=4)
        return tiny_models.write_gguf(hf, tmp_path_factory.mktemp("other-tokenizer") / "other.gguf")
    finally:
        tiny_models.SPECIALS = specials


@pytest.fixture(scope="session")
def default_hf_tokenizer():
    """transformers' tokenizer of the default model, read from its GGUF by transformers' own converter
    (seconds of work, shared by the tokenizer and default-model tests)."""
    from transformers import AutoTokenizer

    from kiln.models.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


POLICY_ENGINE = dict(num_kv_blocks=256, block_size=16, max_loras=2, max_lora_rank=8, decode_row_buckets=(8, 16, 32),
                     prefill_token_buckets=(32, 64, 128), max_num_seqs=32, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def policy_engine(expressive_model):
    """An engine on the expressive tiny llama with LoRA slots, for GRPO and distillation rollouts."""
    from kiln.engine.client import AsyncEngine
    from kiln.engine.config import EngineConfig

    eng = AsyncEngine(expressive_model, EngineConfig(**POLICY_ENGINE))
    yield eng
    eng.shutdown()


def random_prompts(n, seed=0):
    """n prompts of 4-11 random byte tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 250, size=int(rng.integers(4, 12))))) for _ in range(n)]
