"""LoRA adapters: PEFT parity, artifacts and manifests, the registry, live transitions in the engine."""

import asyncio
import json
import random
import threading
import time

import numpy as np
import pytest
from conftest import jit_forward
from peft_adapters import make_peft_adapter, reference_greedy, reference_logits
from tiny_models import make_hf_model, save_hf_model

from kiln.adapters import peft_io
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance, validate_name, weights_digest
from kiln.adapters.registry import AdapterRegistry
from kiln.adapters.store import AdapterStore, load_weights, read_artifact
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.lora_slots import AdapterWeights
from kiln.engine.ownership import Ownership
from kiln.engine.params import SamplingParams
from kiln.errors import InvalidAdapter, InvalidRequest, KilnError
from kiln.models.batch import RowWork, build_step_inputs
from kiln.models.decoder import init_kv_cache
from kiln.models.hf_loader import load_hf_dir
from kiln.models.lora import empty_lora_state, set_slot

SMALL = dict(block_size=16, decode_row_buckets=(1, 2, 4, 8), prefill_token_buckets=(16, 32, 64), max_num_seqs=8,
             max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def hf_tiny():
    """The transformers twin of conftest's tiny_model (same seed, same weights)."""
    return make_hf_model("llama", vocab_size=260, seed=3)


@pytest.fixture(scope="module")
def peft_dirs(hf_tiny, tmp_path_factory):
    """Five PEFT adapters for the tiny model: varied ranks, targets, alphas, rsLoRA."""
    root = tmp_path_factory.mktemp("peft")
    specs = {
        "a0": dict(rank=4, alpha=8.0),
        "a1": dict(rank=8, alpha=4.0, modules=["q_proj", "v_proj", "down_proj"]),
        "a2": dict(rank=2, alpha=16.0, use_rslora=True),
        "a3": dict(rank=16, alpha=16.0, modules=["o_proj", "gate_proj", "up_proj"]),
        "a4": dict(rank=4, alpha=2.0, modules=["k_proj", "q_proj"]),
    }
    return {name: (root / name, make_peft_adapter(hf_tiny, root / name, seed=i, **spec))
            for i, (name, spec) in enumerate(specs.items())}


@pytest.fixture
def engine(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, max_loras=4, max_lora_rank=16, **SMALL))
    yield eng
    eng.shutdown()


@pytest.fixture
def registry(engine, tmp_path):
    return AdapterRegistry(engine, AdapterStore(tmp_path / "store"))


def generate(eng, jobs):
    """jobs: [(prompt, params, adapter weights or None)], all submitted at one iteration
    boundary so they share steps. Returns (token ids, logprobs, last delta) per job."""
    loop_out = {}

    async def main():
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in jobs]

        def submit():
            for i, (prompt, params, adapter) in enumerate(jobs):
                eng.add_request(f"job-{i}-{random.random()}", prompt, params,
                                lambda d, q=queues[i]: loop.call_soon_threadsafe(q.put_nowait, d), adapter=adapter)

        eng.at_boundary(submit)

        async def collect(i):
            ids, lps = [], []
            while True:
                d = await queues[i].get()
                ids += d.token_ids
                lps += [lp.logprob for lp in d.logprobs or []]
                if d.finish_reason is not None:
                    loop_out[i] = (ids, lps, d)
                    return

        await asyncio.gather(*(collect(i) for i in range(len(jobs))))

    asyncio.run(main())
    return [loop_out[i] for i in range(len(jobs))]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---- model-level parity with transformers + peft -------------------------------------------


@pytest.mark.parametrize("variant,rslora", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_peft_adapter_logits_equal_transformers_peft(variant, rslora, tmp_path):
    hf = make_hf_model(variant, seed=5)
    cfg, params, _ = load_hf_dir(save_hf_model(hf, tmp_path / "base"), np.float32, show_progress=False)
    ref_model = make_peft_adapter(hf, tmp_path / "adapter", rank=4, alpha=8.0, seed=1, use_rslora=rslora)
    weights, info = peft_io.read_peft(tmp_path / "adapter", cfg)
    scale = info["alpha"] / (info["rank"] ** 0.5 if rslora else info["rank"])
    state = set_slot(empty_lora_state(cfg, n_slots=2, rank=8), 2, weights, scale)
    ids = list(np.random.RandomState(0).randint(3, cfg.vocab_size, size=37))
    inputs = build_step_inputs([RowWork(ids, 0, [6, 2, 4], 2)], 16)
    got, _ = jit_forward(params, init_kv_cache(cfg, 8, 16), inputs, cfg, state)
    expected = reference_logits(ref_model, ids)
    np.testing.assert_allclose(np.asarray(got)[: len(ids)], expected, atol=1e-4, rtol=0)
    assert np.abs(expected - reference_logits(hf, ids)).max() > 1e-2  # the adapter changes the output


def test_peft_export_round_trip_loads_in_peft(registry, peft_dirs, hf_tiny, tmp_path):
    from peft import PeftModel

    entry = registry.load("a2", str(peft_dirs["a2"][0]))
    m = entry.artifact.manifest
    out = peft_io.write_peft(tmp_path / "export", load_weights(entry.artifact), m.rank, m.alpha, m.use_rslora,
                             m.base_model.id)
    reloaded = PeftModel.from_pretrained(make_hf_model("llama", vocab_size=260, seed=3), str(out)).eval()
    ids = [5, 9, 33, 71, 2, 200, 13]
    np.testing.assert_allclose(reference_logits(reloaded, ids), reference_logits(peft_dirs["a2"][1], ids),
                               atol=1e-5, rtol=0)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (2, 16.0, True)


def test_peft_import_refuses_what_it_cannot_serve(tiny_model, peft_dirs, tmp_path):
    cfg = tiny_model.config
    src = peft_dirs["a0"][0]
    for option, value in (("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")):
        bad = tmp_path / option
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
        config = json.loads((src / "adapter_config.json").read_text())
        config[option] = value
        (bad / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(InvalidAdapter, match=option):
            peft_io.read_peft(bad, cfg)
    other = make_hf_model("llama", vocab_size=260, seed=3, hidden_size=32, intermediate_size=64)
    make_peft_adapter(other, tmp_path / "wrong-shapes")
    with pytest.raises(InvalidAdapter, match="expected"):
        peft_io.read_peft(tmp_path / "wrong-shapes", cfg)


# ---- artifacts and the store ----------------------------------------------------------------


def _manifest(name, model, rank=4, base_digest=None):
    return Manifest(name=name, base_model=BaseModelRef(model.model_id, base_digest or model.weights_digest), rank=rank,
                    alpha=8.0, target_modules=["q_proj"], weights_digest="", provenance=provenance("test"))


def _weights(model, rank=4, seed=0):
    cfg = model.config
    rng = np.random.RandomState(seed)
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return {"q_proj": {"a": rng.randn(cfg.num_layers, h, rank).astype(np.float32),
                       "b": rng.randn(cfg.num_layers, rank, q).astype(np.float32)}}


def test_store_versions_manifest_and_integrity(tiny_model, tmp_path):
    store = AdapterStore(tmp_path, keep_versions=2)
    w1, w2 = _weights(tiny_model, seed=1), _weights(tiny_model, seed=2)
    first = store.save(_manifest("sql", tiny_model), w1, opt_state={"mu": np.ones(3, np.float32)})
    second = store.save(_manifest("sql", tiny_model), w2)
    assert (first.version, second.version) == ("000001", "000002")
    latest = store.latest("sql")
    assert latest.manifest_digest == second.manifest_digest != first.manifest_digest
    m = latest.manifest
    assert m.weights_digest == weights_digest(w2) and m.base_model.weights_digest == tiny_model.weights_digest
    assert {"kiln_version", "jax_version", "backend", "device_kind", "created_at", "parent_adapter"} <= set(
        json.loads((latest.path / "manifest.json").read_text())["provenance"])
    np.testing.assert_array_equal(load_weights(latest)["q_proj"]["b"], w2["q_proj"]["b"])
    assert first.manifest.has_optimizer_state and not m.has_optimizer_state
    store.save(_manifest("sql", tiny_model), w1)
    assert sorted(p.name for p in (tmp_path / "sql").iterdir()) == ["000002", "000003"]  # keep_versions=2
    assert [a.name for a in store.list()] == ["sql"]
    # a manifest that does not match its checkpoint is refused
    (latest.path / "manifest.json").write_bytes(
        latest.path.joinpath("manifest.json").read_bytes().replace(m.weights_digest.encode(), b"sha256:" + b"0" * 64))
    with pytest.raises(InvalidAdapter, match="weights digest"):
        load_weights(read_artifact(latest.path))


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "a..b", "x" * 129, "a b", "a\\b"])
def test_adapter_names_are_plain_identifiers(name):
    with pytest.raises(InvalidRequest, match="invalid adapter name"):
        validate_name(name)


def test_registry_refuses_foreign_base_and_oversized_rank(registry, tiny_model, tmp_path):
    store = AdapterStore(tmp_path / "elsewhere")
    foreign = store.save(_manifest("foreign", tiny_model, base_digest="sha256:" + "1" * 64), _weights(tiny_model))
    with pytest.raises(KilnError, match="was made for base model") as err:
        registry.load("foreign", str(foreign.path))
    assert err.value.code == "adapter_base_model_mismatch"
    big = store.save(_manifest("big", tiny_model, rank=32), _weights(tiny_model, rank=32))
    with pytest.raises(KilnError, match="rank 32 exceeds max_lora_rank 16"):
        registry.load("big", str(big.path))
    with pytest.raises(KilnError) as err:
        registry.load("nothing", str(tmp_path / "missing"))
    assert err.value.status == 404
    with pytest.raises(KilnError, match="invalid adapter name"):
        registry.load("../etc", None)
    assert registry.loaded() == [] and registry.engine.snapshot["resident_adapters"] == []


# ---- serving through the engine -------------------------------------------------------------


def test_engine_with_adapter_equals_transformers_peft(registry, engine, peft_dirs):
    prompt = [7, 44, 101, 9, 250, 3, 18, 66, 12]
    entry = registry.load("a0", str(peft_dirs["a0"][0]))
    (ids, lps, last), = generate(engine, [(prompt, GREEDY, entry.weights)])
    ref_model = peft_dirs["a0"][1]
    assert ids == reference_greedy(ref_model, prompt, 10)
    ref = log_softmax(reference_logits(ref_model, prompt + ids[:-1]))[len(prompt) - 1:]
    np.testing.assert_allclose(lps, ref[np.arange(len(ids)), ids], atol=1e-4)
    assert last.usage["completion_tokens"] == 10


def test_four_adapters_in_one_batch_equal_their_single_requests(registry, engine, peft_dirs):
    entries = [registry.load(n, str(peft_dirs[n][0])) for n in ("a0", "a1", "a2", "a3")]
    prompts = [[5 + i, 80, 31 * i % 250 + 3, 17, 99, 140 + i] for i in range(5)]
    jobs = [(prompts[i], GREEDY, e.weights) for i, e in enumerate(entries)] + [(prompts[4], GREEDY, None)]
    steps_before = engine.snapshot["steps"]
    batched = generate(engine, jobs)
    assert engine.snapshot["steps"] - steps_before <= 12  # all five rows shared the steps
    singles = [generate(engine, [job])[0] for job in jobs]
    for (ids, lps, _), (ref_ids, ref_lps, _) in zip(batched, singles, strict=True):
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
    assert len({tuple(b[0]) for b in batched[:4]}) == 4  # the adapters differ
    for i, name in enumerate(("a0", "a1", "a2", "a3")):
        assert batched[i][0] == reference_greedy(peft_dirs[name][1], prompts[i], 10)


def test_prefix_cache_never_shares_kv_across_adapters_or_versions(registry, engine, peft_dirs):
    prompt = list(range(3, 3 + 40))
    a0 = registry.load("a0", str(peft_dirs["a0"][0])).weights
    base = generate(engine, [(prompt, GREEDY, None)])[0]
    first = generate(engine, [(prompt, GREEDY, a0)])[0]
    assert first[2].usage["cached_tokens"] == 0  # the base model's blocks are not reused
    assert generate(engine, [(prompt, GREEDY, a0)])[0][2].usage["cached_tokens"] == 32
    a0v2 = registry.load("a0", str(peft_dirs["a4"][0]), replace=True).weights
    second = generate(engine, [(prompt, GREEDY, a0v2)])[0]
    assert second[2].usage["cached_tokens"] == 0  # same name, new version: fresh prefill
    assert base[0] != first[0] != second[0]


def test_more_adapters_than_slots_rotate_lru(tiny_model, peft_dirs, tmp_path):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, max_loras=2, max_lora_rank=16, **SMALL))
    try:
        reg = AdapterRegistry(eng, AdapterStore(tmp_path / "store"))
        entries = [reg.load(n, str(peft_dirs[n][0])) for n in ("a0", "a1", "a2", "a4")]
        assert len(eng.snapshot["resident_adapters"]) == 2
        jobs = [([9, 8, 7, 6, 5 + i], GREEDY, e.weights) for i, e in enumerate(entries)]
        together = generate(eng, jobs)  # four adapters, two slots: the last two wait for a slot
        alone = [generate(eng, [job])[0] for job in jobs]
        assert [t[0] for t in together] == [a[0] for a in alone]
        assert eng.snapshot["lora_evictions"] >= 2
        assert all(r["requests"] == 0 for r in eng.snapshot["resident_adapters"])
        resident = {r["adapter"] for r in eng.snapshot["resident_adapters"]}
        idle = next(n for n in ("a0", "a1", "a2", "a4") if n not in resident)
        assert reg.activate(idle) in (1, 2) and idle in {r["adapter"] for r in eng.snapshot["resident_adapters"]}
    finally:
        eng.shutdown()


def test_a_store_that_cannot_be_written_and_weights_that_cannot_be_placed_fail_their_request_only(
        tiny_model, engine, peft_dirs, tmp_path):
    """adapter_store_error: importing a PEFT directory into a store that cannot be written (a file);
    adapter_transition_failed: a request on weights its slot cannot take (another model's shapes)
    fails alone, and the next request is served."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the store should be")
    with pytest.raises(KilnError) as err:
        AdapterRegistry(engine, AdapterStore(blocked)).load("a0", str(peft_dirs["a0"][0]))
    assert (err.value.status, err.value.code) == (500, "adapter_store_error")
    other = make_hf_model("llama", vocab_size=260, seed=3, hidden_size=32, intermediate_size=64)
    wrong = {"q_proj": {"a": np.zeros((other.config.num_hidden_layers, 32, 4), np.float32),
                        "b": np.zeros((other.config.num_hidden_layers, 4, 32), np.float32)}}
    with pytest.raises(KilnError) as err:
        engine.complete([[5, 6, 7]], GREEDY, adapter=AdapterWeights("wrong", "v1", wrong, 1.0, 4), timeout=60)
    assert (err.value.status, err.value.code) == (500, "adapter_transition_failed")
    [[ok]] = engine.complete([[5, 6, 7]], GREEDY, timeout=60)
    assert ok.finish_reason == "length"


def test_replace_and_unload_never_mix_versions_in_one_request(registry, engine, peft_dirs):
    """A request keeps the version it started with; new requests get the new one."""
    prompt = [11, 22, 33, 44, 55]
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, logprobs=0)
    v1 = registry.load("live", str(peft_dirs["a0"][0])).weights
    pure_v1 = generate(engine, [(prompt, long, v1)])[0][0]
    results = {}

    def run_long():
        results["long"] = generate(engine, [(prompt, long, v1)])[0][0]

    t = threading.Thread(target=run_long)
    t.start()
    deadline = time.monotonic() + 60
    while not any(r["requests"] for r in engine.snapshot["resident_adapters"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert t.is_alive()  # the replacement below lands mid-generation
    v2 = registry.load("live", str(peft_dirs["a1"][0]), replace=True).weights
    after = generate(engine, [(prompt, GREEDY, registry.get("live").weights)])[0][0]
    t.join()
    assert results["long"] == pure_v1  # finished on v1 although v2 arrived mid-generation
    assert after == generate(engine, [(prompt, GREEDY, v2)])[0][0] != pure_v1[:10]
    assert v1.retired and not v2.retired
    assert [r["version"] for r in engine.snapshot["resident_adapters"]] == [v2.version]  # v1's slot freed once idle
    registry.unload("live")
    assert registry.get("live") is None and engine.snapshot["resident_adapters"] == []
    with pytest.raises(KilnError, match="cannot be found") as err:
        registry.unload("live")
    assert err.value.status == 404


def test_waiting_writer_gets_the_next_boundary_and_inference_resumes(engine, registry, peft_dirs):
    """Writer priority: while a writer holds the accelerator no step runs; then steps go on."""
    prompt = [3, 4, 5, 6]
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("out", generate(engine, [(prompt, long, None)])))
    t.start()
    deadline = time.monotonic() + 60
    while engine.snapshot["steps"] < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    with engine.ownership.write("test writer"):
        time.sleep(0.05)  # the step that ended as the writer took over publishes its snapshot
        frozen = engine.snapshot["steps"]
        time.sleep(0.3)
        assert engine.snapshot["steps"] == frozen  # no inference step while the writer holds it
        assert engine.ownership.snapshot()["active_writer"] == "test writer"
    t.join(timeout=60)
    assert len(results["out"][0][0]) == 60
    assert engine.ownership.writes >= 1


def test_ownership_is_writer_priority():
    own = Ownership()
    order = []
    inside = threading.Event()

    def step(tag):
        with own.inference():
            order.append(tag)
            inside.set()
            time.sleep(0.05)

    first = threading.Thread(target=step, args=("step1",))
    first.start()
    inside.wait()
    def write():
        with own.write("w"):
            order.append("write")

    writer = threading.Thread(target=write)
    writer.start()
    while not own.snapshot()["waiting_writers"]:
        time.sleep(0.001)
    second = threading.Thread(target=step, args=("step2",))
    second.start()
    for th in (first, writer, second):
        th.join()
    assert order == ["step1", "write", "step2"]  # the step that came after the writer waited


SAVER = """
import sys, numpy as np
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
from kiln.adapters.store import AdapterStore
store = AdapterStore(sys.argv[1], keep_versions=100)
for i in range(1, 1000):
    rng = np.random.RandomState(i)
    weights = {"q_proj": {"a": rng.randn(4, 1024, 512).astype(np.float32),
                          "b": rng.randn(4, 512, 1024).astype(np.float32)}}
    store.save(Manifest(name="job", base_model=BaseModelRef("m", sys.argv[2]), rank=512, alpha=1.0,
                        target_modules=["q_proj"], weights_digest="", provenance=provenance("test")), weights)
    print("saved", i, flush=True)
"""


def test_kill_9_during_save_keeps_the_previous_artifact(tmp_path, tiny_model):
    import os
    import signal
    import subprocess
    import sys

    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(root), tiny_model.weights_digest],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout.readline().split() == ["saved", "1"]
    caught = None
    deadline = time.monotonic() + 120
    while caught is None and time.monotonic() < deadline:  # kill the saver while a version is half written
        for v in sorted((root / "job").iterdir()):
            if v.is_dir() and not (v / "manifest.json").exists():
                proc.send_signal(signal.SIGKILL)
                caught = v.name
                break
        time.sleep(0.001)
    proc.wait()
    assert caught is not None, "never observed a save in progress"
    assert caught.startswith(".staging-")  # a save in progress is never a version directory
    store = AdapterStore(root)
    latest = store.latest("job")
    versions = sorted(p.name for p in (root / "job").iterdir() if p.name.isdigit())
    assert versions[-1] == latest.version  # every version directory is complete; the last one is current
    rng = np.random.RandomState(int(latest.version))
    expected = {"q_proj": {"a": rng.randn(4, 1024, 512).astype(np.float32),
                           "b": rng.randn(4, 512, 1024).astype(np.float32)}}
    assert latest.manifest.weights_digest == weights_digest(expected)
    assert weights_digest(load_weights(latest)) == latest.manifest.weights_digest
    assert store.names() == ["job"]
    # the next save after the crash succeeds; the half-written leftover is never read as a version
    again = store.save(_manifest("job", tiny_model), _weights(tiny_model))
    assert int(again.version) == int(latest.version) + 1
    assert store.latest("job").manifest_digest == again.manifest_digest


def test_registry_after_restart_serves_the_store(tiny_model, peft_dirs, tmp_path):
    """A new process (engine + registry) on the same store finds the imported artifact intact."""
    root = tmp_path / "store"
    first = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, **SMALL))
    try:
        digest = AdapterRegistry(first, AdapterStore(root)).load("a0", str(peft_dirs["a0"][0])).artifact.manifest_digest
    finally:
        first.shutdown()
    second = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, **SMALL))
    try:
        reg = AdapterRegistry(second, AdapterStore(root))
        assert [(a["name"], a["loaded"]) for a in reg.describe_all()] == [("a0", False)]
        entry = reg.load("a0")
        assert entry.artifact.manifest_digest == digest and entry.source == "store"
        prompt = [7, 44, 101, 9]
        expected = reference_greedy(peft_dirs["a0"][1], prompt, 10)
        assert generate(second, [(prompt, GREEDY, entry.weights)])[0][0] == expected
    finally:
        second.shutdown()


def test_cli_imports_lists_and_exports_peft(tiny_model, peft_dirs, tmp_path, kiln_cache):
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, "JAX_PLATFORMS": "cpu",
           "KILN_MODEL_PATH": tiny_model.source, "KILN_CACHE_DIR": str(kiln_cache),
           "KILN_ADAPTERS_STORE": str(tmp_path / "store")}

    def kiln(*args):
        proc = subprocess.run([sys.executable, "-m", "kiln", "adapters", *args], env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        return proc.stdout

    kiln("import", "a1", str(peft_dirs["a1"][0]))
    (row,) = json.loads(kiln("list", "--json"))
    assert (row["name"], row["rank"], row["alpha"], row["version"]) == ("a1", 8, 4.0, "000001")
    kiln("export", "a1", str(tmp_path / "out"))
    original = load_file(str(peft_dirs["a1"][0] / "adapter_model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert sorted(original) == sorted(exported)
    for key in original:
        np.testing.assert_array_equal(original[key], exported[key])
    proc = subprocess.run([sys.executable, "-m", "kiln", "adapters", "export", "nope", str(tmp_path / "x")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "no adapter named 'nope'" in proc.stdout


CONCURRENT_SAVER = """
import sys
import numpy as np
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
from kiln.adapters.store import AdapterStore

root, who = sys.argv[1], int(sys.argv[2])
store = AdapterStore(root, keep_versions=0)
for i in range(6):
    a, b = np.full((2, 64, 4), 100 * who + i, np.float32), np.full((2, 4, 64), who, np.float32)
    weights = {"q_proj": {"a": a, "b": b}}
    manifest = Manifest(name="shared", base_model=BaseModelRef("tiny", "sha256:0"), rank=4, alpha=8.0,
                        target_modules=["q_proj"], weights_digest="", provenance=provenance("test"))
    store.save(manifest, weights)
"""


def test_two_processes_saving_one_name_on_a_shared_store_never_mix(tmp_path):
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_SAVER, str(tmp_path), str(who)]) for who in (1, 2)]
    assert [p.wait(300) for p in procs] == [0, 0]
    adapter_dir = tmp_path / "shared"
    versions = sorted(p.name for p in adapter_dir.iterdir() if not p.name.startswith("."))
    assert versions == [f"{i:06d}" for i in range(1, 13)]  # every save got a version of its own
    order = {1: [], 2: []}
    for version in versions:
        weights = load_weights(read_artifact(adapter_dir / version))  # the digest matches the manifest
        a, b = weights["q_proj"]["a"], weights["q_proj"]["b"]
        assert len(np.unique(a)) == 1 and len(np.unique(b)) == 1  # one writer's weights, never a mix
        who = int(b.flat[0])
        assert int(a.flat[0]) // 100 == who
        order[who].append(int(a.flat[0]) % 100)
    assert order == {1: list(range(6)), 2: list(range(6))}  # each writer's saves in order
    assert AdapterStore(tmp_path).latest("shared").version == "000012"  # the later save wins
