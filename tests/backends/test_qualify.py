"""`kiln qualify`: an IREE route's parity suite against XLA on the tiny model, written down as a
receipt under the data directory; an unavailable route exits 2; receipts never steer routing."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("iree.runtime")

from test_iree_route import VULKAN  # noqa: E402

KILN = Path(__file__).resolve().parents[2] / "kiln"


@pytest.fixture(scope="module")
def cache(kiln_cache):
    """The session's cache, with the IREE servers' engine settings below: compiled modules (and
    XLA executables) are shared with tests/backends/test_iree_server.py and between these runs."""
    return kiln_cache


def _env(cache, data_dir, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_CACHE_DIR=str(cache), KILN_TRAIN_DATA_DIR=str(data_dir), KILN_ENGINE_DECODE_ROW_BUCKETS="1,4",
               KILN_ENGINE_PREFILL_TOKEN_BUCKETS="32", KILN_ENGINE_MAX_NUM_SEQS="4",
               KILN_ENGINE_MAX_NUM_BATCHED_TOKENS="32", KILN_ENGINE_NUM_KV_BLOCKS="32", JAX_PLATFORMS="cpu", **extra)
    return env


def kiln_qualify(env, *args):
    return subprocess.run([sys.executable, "-m", "kiln", "qualify", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)


def _receipts(data_dir, route):
    return sorted((data_dir / "receipts").glob(f"{route}-*.json"))


def test_iree_cpu_qualifies_and_writes_a_receipt(tiny_model, cache, tmp_path):
    data = tmp_path / "data"
    out = kiln_qualify(_env(cache, data), "--route", "iree-cpu", "--model", tiny_model.source, "--json",
                       "--tokens", 6, "--prompts", 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    receipt = json.loads(out.stdout)
    [path] = _receipts(data, "iree-cpu")
    assert re.fullmatch(r"iree-cpu-\d{8}T\d{6}Z\.json", path.name)
    assert json.loads(path.read_text()) == receipt
    assert receipt["route"] == "iree-cpu" and receipt["passed"] is True
    caps = receipt["capabilities"]
    assert caps["route"] == "iree-cpu" and caps["device_type"] == "cpu" and "name" in caps and "driver" in caps
    assert receipt["gates"] == {"sort": True, "top_k": True}
    versions = receipt["versions"]
    for dist in ("kiln", "jax", "jaxlib", "iree-base-compiler", "iree-base-runtime"):
        assert versions[dist], dist
    assert "driver" in versions
    assert receipt["started_at"] <= receipt["ended_at"] and receipt["duration_s"] > 0
    assert receipt["model"]["dtype"] == "float32" and receipt["engine"]["resident_prefill"] is False
    checks = {c["name"]: c for c in receipt["checks"]}
    assert set(checks) == {"greedy_tokens", "step_buckets", "seeded_sampling_temperature", "seeded_sampling_top_k",
                           "seeded_sampling_top_p", "seeded_sampling_top_k_top_p"}
    assert all(c["passed"] for c in checks.values())
    greedy = checks["greedy_tokens"]["prompts"]
    assert len(greedy) == 2 and all(len(p["tokens"]) == 6 and p["tokens"] == p["xla_tokens"] for p in greedy)
    assert checks["seeded_sampling_top_k"]["params"]["seed"] is not None
    buckets = checks["step_buckets"]
    assert buckets["buckets"] and all(b["tokens_equal"] for b in buckets["buckets"])
    assert {"decode", "prefill"} <= {b["shape"]["kind"] for b in buckets["buckets"]}
    assert 0 <= buckets["max_logprob_error"] <= buckets["tolerances"]["logprob"]
    assert 0 <= buckets["max_kv_error"] <= buckets["tolerances"]["kv_relative"]


@VULKAN
def test_vulkan_qualifies_on_this_device(tiny_model, cache, tmp_path):
    data = tmp_path / "data"
    out = kiln_qualify(_env(cache, data), "--route", "vulkan", "--model", tiny_model.source, "--tokens", 3,
                       "--prompts", 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("qualify vulkan: PASS"), out.stdout
    [path] = _receipts(data, "vulkan")
    assert f"receipt: {path}" in out.stdout
    receipt = json.loads(path.read_text())
    assert receipt["passed"] and receipt["capabilities"]["route"] == "vulkan"
    assert receipt["versions"]["driver"] == receipt["capabilities"]["driver"]


def test_a_failing_check_exits_1_and_still_writes_the_receipt(tiny_model, cache, tmp_path):
    """With the bucket gate's tolerance below any error, every bucket is refused: the greedy check
    fails (the steps are refused, never answered wrongly) and the receipt says so. The same
    prompts and tokens as the iree-cpu run above: its compiled modules are reused."""
    data = tmp_path / "data"
    code = ("import sys; import kiln.engine.bucket_gate as g; g.LOGPROB_TOL = -1.0; from kiln.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", code, "qualify", "--route", "iree-cpu", "--model", tiny_model.source,
                          "--tokens", "6", "--prompts", "2"], env=_env(cache, data), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("qualify iree-cpu: FAIL"), out.stdout
    [path] = _receipts(data, "iree-cpu")
    receipt = json.loads(path.read_text())
    checks = {c["name"]: c for c in receipt["checks"]}
    assert receipt["passed"] is False and checks["greedy_tokens"]["passed"] is False
    assert checks["greedy_tokens"]["error"].startswith("BackendCannotRun: no step bucket")
    refused = checks["step_buckets"]["refused_by_gate"]
    assert refused and all("logprobs differ" in r["why"] for r in refused)


def test_unavailable_route_exits_2_and_names_it(tiny_model, cache, tmp_path):
    """No Vulkan ICD: the message names the route and how to install a driver; no receipt."""
    nowhere = str(tmp_path / "none.json")
    data = tmp_path / "data"
    out = kiln_qualify(_env(cache, data, VK_ICD_FILENAMES=nowhere, VK_DRIVER_FILES=nowhere), "--route", "vulkan",
                       "--model", tiny_model.source)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "kiln: error: qualify: route vulkan" in out.stderr and "mesa-vulkan-drivers" in out.stderr, out.stderr
    assert not (data / "receipts").exists()


def _receipt(route, passed):
    return {"kind": "kiln.qualification_receipt", "route": route, "passed": passed, "gates": {"sort": passed},
            "capabilities": {"route": route, "device_type": "gpu", "dtypes": ["f32"]}, "checks": []}


@pytest.mark.parametrize("passed", [False, True])
def test_receipts_never_steer_route_choice(tiny_model, tmp_path, monkeypatch, passed):
    """Receipts in the data directory, saying a route failed (or passed), change no choice:
    select_backend and engine startup choose exactly as without them."""
    from kiln.cli import settings_from_argv
    from kiln.engine.setup import select_backend_from_settings
    from kiln.qualify import receipts_dir

    monkeypatch.setenv("KILN_TRAIN_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KILN_BACKEND_IREE_CACHE_DIR", str(tmp_path / "iree"))

    def choices():
        out = []
        for requested in ("auto", "iree-cpu", "xla"):
            monkeypatch.setenv("KILN_BACKEND_ROUTE", requested)
            choice = select_backend_from_settings(settings_from_argv([]), tiny_model).choice
            out.append((choice.route, choice.reason, choice.gates))
        return out

    before = choices()
    directory = receipts_dir(settings_from_argv([]))
    directory.mkdir(parents=True)
    for route in ("vulkan", "iree-cpu", "xla"):
        (directory / f"{route}-20260101T000000Z.json").write_text(json.dumps(_receipt(route, passed)))
    assert choices() == before
    assert before[1][0] == "iree-cpu" and before[2][0] == "xla"


def test_only_the_qualify_module_knows_the_receipts_directory():
    """Nothing under kiln/ but kiln/qualify.py names the receipts directory, and only the CLI
    imports the qualify module: no routing code can read a receipt."""
    named, importers = [], []
    for path in KILN.rglob("*.py"):
        rel = path.relative_to(KILN.parent).as_posix()
        text = path.read_text()
        if rel != "kiln/qualify.py" and re.search(r"""["']receipts["']|receipts_dir|\bRECEIPTS\b""", text):
            named.append(rel)
        if rel != "kiln/qualify.py" and re.search(r"kiln\.qualify|from kiln import qualify", text):
            importers.append(rel)
    assert named == []
    assert importers == ["kiln/cli.py"]
