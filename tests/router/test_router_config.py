"""The router's configuration (kiln/router/config.py): every key and default, every rule, the CLI."""

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.router import config as router_config
from kiln.router.config import RouterConfig, RouterConfigError, endpoint_from_url, load_router_config

ROOT = Path(__file__).resolve().parents[2]

# ---- a small TOML writer, so that each case is a dict -------------------------------------------


def _is_tables(value):
    return isinstance(value, list) and value and all(isinstance(v, dict) for v in value)


def to_toml(doc: dict, prefix: str = "") -> str:
    """Scalars and arrays as `key = value`; dicts as [tables]; lists of dicts as [[arrays of tables]]."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict) and not _is_tables(v)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += [f"[{prefix}{k}]", to_toml(v, f"{prefix}{k}.")]
        elif _is_tables(v):
            for item in v:
                lines += [f"[[{prefix}{k}]]", to_toml(item, f"{prefix}{k}.")]
    return "\n".join(lines) + "\n"


WORKER = {"worker_id_str": "w0", "worker_id_num": 0, "model_name": "m", "zmq_endpoint": "tcp://10.0.0.5:5557"}


def minimal() -> dict:
    """The least a config needs: listen, a profile and a static worker set."""
    return {
        "listen": "0.0.0.0:50051",
        "profile": [{"name": "p"}],
        "workerset": [{"name": "a", "profile": "p", "kv_block_size": 16, "discovery": {"workers_file": "w.toml"}}],
    }


def write(tmp_path: Path, doc: dict, workers=None, name: str = "router.toml") -> Path:
    """The config file, and its workers file (w.toml) holding `workers` (one default worker if None)."""
    (tmp_path / "w.toml").write_text(to_toml({"workers": [WORKER] if workers is None else workers}))
    path = tmp_path / name
    path.write_text(to_toml(doc))
    return path


def load(tmp_path: Path, doc: dict, workers=None) -> RouterConfig:
    return load_router_config(write(tmp_path, doc, workers))


def error(tmp_path: Path, doc: dict, workers=None) -> str:
    with pytest.raises(RouterConfigError) as e:
        load(tmp_path, doc, workers)
    return str(e.value)


@pytest.fixture(autouse=True)
def no_kubernetes_credentials(tmp_path, monkeypatch):
    """Every test starts outside a cluster and without a kubeconfig."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(router_config, "SERVICE_ACCOUNT_TOKEN", tmp_path / "no-token")


# ---- defaults ------------------------------------------------------------------------------------

PREDICTOR_DEFAULTS = {
    "base_ms": 400.0,
    "forward_pass_ms": 0.0,
    "queue_ms_per_entry": 1000.0,
    "attention_uncached_block_ms": 2.3,
    "attention_uncached_per_every_block_ms": 0.009,
    "cache_pressure_penalty_ms": 0.0,
    "cache_pressure_saturated_threshold": 0.9,
    "saturated_cold_ms_per_entry": 10000.0,
    "q_running_penalty_peak_ms": 700.0,
    "q_running_penalty_peak_qr": 2,
    "q_running_penalty_falloff_qr": 5,
    "inflight_concurrent_capacity": 5,
    "expected_overlap_alpha": 1.0,
    "adapter_load_ms": 1000.0,
}
PICKER_DEFAULTS = {
    "top_k_min": 2,
    "top_k_fraction": 0.2,
    "tie_tolerance_ms": 50.0,
    "inflight_tracking": True,
    "replication_threshold_pct": 0.0,
    "replication_warm_target": 2,
    "replication_warm_threshold_fraction": 0.5,
}
PORT_DEFAULTS = {"http_port": 8000, "zmq_port": 5557, "replay_port": None}
WORKER_DEFAULTS = {
    "zmq_endpoint": None,
    "replay_endpoint": None,
    "metrics_url": None,
    "http_url": None,
    "endpoint": None,
    "pod_name": None,
    "namespace": None,
    "node_name": None,
    "node_ip": None,
    "pod_ip": None,
    "availability_zone": None,
    "instance_type": None,
}
TOP_DEFAULTS = {
    "admin_listen": None,
    "mock_mode": False,
    "dashboard_max_workers": 16,
    "metrics_poll_ms": 1000,
    "models_refresh_secs": 30,
    "replay_timeout_ms": 60000,
    "observation_ttl_secs": 600,
    "body_max_total_kb": 262144,
    "body_max_request_kb": 8192,
    "body_ttl_secs": 60,
    "body_idle_timeout_secs": 30,
    "tokenize": {"pool_max_idle_per_host": None, "local": {"mount_dir": None, "warmup": True}},
    "metrics": {"tenant_labels": "none"},
    "policy": {"enabled": False, "namespace": None},
    "kubernetes": {"enabled": False, "namespace": None, "selector": None, "discovery_defaults": PORT_DEFAULTS},
    "token_review": {
        "enabled": False,
        "default_deadline_ms": 2000,
        "positive_ttl_secs": 60,
        "negative_ttl_secs": 10,
        "max_cache_entries": 4096,
    },
    "rate_limit": {"enabled": False},
    "leader_election": {
        "enabled": False,
        "lease_name": "bllmp",
        "namespace": None,
        "lease_duration_secs": 15,
        "renew_grace_secs": 10,
        "retry_secs": 2,
    },
    "rollout": {"state_file": None, "bake_secs": 30.0, "max_error_rate": 0.05, "drain_secs": 2.0},
}


def test_a_minimal_config_gets_every_default(tmp_path):
    got = load(tmp_path, minimal()).to_json()
    assert got == {
        "listen": "0.0.0.0:50051",
        **TOP_DEFAULTS,
        "profile": [
            {"name": "p", "tokenize": {"mode": "render"}, "predictor": PREDICTOR_DEFAULTS, "picker": PICKER_DEFAULTS}
        ],
        "workerset": [
            {
                "name": "a",
                "profile": "p",
                "kv_block_size": 16,
                "render_url": None,
                "discovery": {
                    "mode": "static",
                    "workers_file": str(tmp_path / "w.toml"),
                    "service_name": None,
                    "namespace": None,  # inherited
                    "defaults": PORT_DEFAULTS,
                },
                "workers": [{**WORKER_DEFAULTS, **WORKER}],
            }
        ],
    }


def test_the_model_is_typed_and_frozen(tmp_path):
    config = load(tmp_path, minimal())
    assert isinstance(config.profile, tuple) and isinstance(config.workerset[0].workers, tuple)
    assert config.profile_named("p").predictor.base_ms == 400.0
    assert isinstance(config.workerset[0].discovery.workers_file, Path)
    with pytest.raises(Exception, match="frozen"):
        config.listen = "elsewhere"
    with pytest.raises(Exception, match="frozen"):
        config.workerset[0].workers[0].worker_id_num = 3


# ---- every key set ---------------------------------------------------------------------------------


def full() -> dict:
    """Every key of the file, each with a value other than its default."""
    predictor = {k: (v + 1 if isinstance(v, int) else v + 0.5) for k, v in PREDICTOR_DEFAULTS.items()}
    ports = {"http_port": 8080, "zmq_port": 6000, "replay_port": 6001}
    return {
        "listen": "127.0.0.1:7000",
        "admin_listen": "127.0.0.1:9090",
        "mock_mode": True,
        "dashboard_max_workers": 64,
        "metrics_poll_ms": 250,
        "models_refresh_secs": 5,
        "replay_timeout_ms": 1234,
        "observation_ttl_secs": 99,
        "body_max_total_kb": 1024,
        "body_max_request_kb": 512,
        "body_ttl_secs": 7,
        "body_idle_timeout_secs": 3,
        "profile": [
            {
                "name": "fast",
                "tokenize": {"mode": "local"},
                "predictor": predictor,
                "picker": {
                    "top_k_min": 3,
                    "top_k_fraction": 0.4,
                    "tie_tolerance_ms": 10.5,
                    "inflight_tracking": False,
                    "replication_threshold_pct": 12.5,
                    "replication_warm_target": 4,
                    "replication_warm_threshold_fraction": 0.75,
                },
            },
            {"name": "slow", "tokenize": {"mode": "compare"}},
        ],
        "workerset": [
            {
                "name": "a",
                "profile": "fast",
                "kv_block_size": 32,
                "render_url": "http://render:8000/render",
                "discovery": {
                    "mode": "static",
                    "workers_file": "w.toml",
                    "service_name": "ignored-for-static",
                    "namespace": "serving",
                    "defaults": ports,
                },
            },
            {
                "name": "b",
                "profile": "slow",
                "kv_block_size": 16,
                "discovery": {"mode": "kubernetes", "service_name": "llm-b", "namespace": "other"},
            },
        ],
        "tokenize": {"pool_max_idle_per_host": 8, "local": {"mount_dir": "/models", "warmup": False}},
        "metrics": {"tenant_labels": ["acme", "globex"]},
        "policy": {"enabled": True, "namespace": "policies"},
        "kubernetes": {"enabled": True, "namespace": "k8s", "selector": "team=x", "discovery_defaults": ports},
        "token_review": {
            "enabled": False,
            "default_deadline_ms": 500,
            "positive_ttl_secs": 30,
            "negative_ttl_secs": 5,
            "max_cache_entries": 16,
        },
        "rate_limit": {"enabled": True},
        "leader_election": {
            "enabled": True,
            "lease_name": "kiln-router",
            "namespace": "leases",
            "lease_duration_secs": 30,
            "renew_grace_secs": 20,
            "retry_secs": 4,
        },
        "rollout": {"state_file": "/var/lib/kiln/rollouts.json", "bake_secs": 120.0, "max_error_rate": 0.01,
                    "drain_secs": 5.0},
    }


FULL_WORKER = {
    "worker_id_str": "w0",
    "worker_id_num": 10,
    "model_name": "llama",
    "zmq_endpoint": "tcp://10.0.0.5:5557",
    "replay_endpoint": "tcp://10.0.0.5:5558",
    "metrics_url": "http://10.0.0.5:8000/metrics",
    "http_url": "http://10.0.0.5:8000",
    "endpoint": "lb.example:443",
    "pod_name": "pod-0",
    "namespace": "serving",
    "node_name": "node-a",
    "node_ip": "10.0.1.1",
    "pod_ip": "10.0.0.5",
    "availability_zone": "zone-a",
    "instance_type": "h200",
}


def test_every_key_set_parses_to_its_value(tmp_path):
    doc = full()
    got = load(tmp_path, doc, workers=[FULL_WORKER, {**WORKER, "worker_id_str": "w1", "worker_id_num": 11}]).to_json()
    want = copy.deepcopy(doc)
    want["workerset"][0]["discovery"]["workers_file"] = str(tmp_path / "w.toml")
    want["workerset"][0]["workers"] = [
        FULL_WORKER,
        {**WORKER_DEFAULTS, **WORKER, "worker_id_str": "w1", "worker_id_num": 11},
    ]
    want["workerset"][1]["render_url"] = None
    want["workerset"][1]["discovery"].update(workers_file=None, defaults=PORT_DEFAULTS)
    want["workerset"][1]["workers"] = []  # found at run time
    want["profile"][1].update(predictor=PREDICTOR_DEFAULTS, picker=PICKER_DEFAULTS)
    assert got == want


def test_dotted_keys_are_the_same_as_sub_tables(tmp_path):
    path = tmp_path / "router.toml"
    (tmp_path / "w.toml").write_text(to_toml({"workers": [WORKER]}))
    path.write_text(
        'listen = "x"\n[[profile]]\nname = "p"\ntokenize.mode = "compare"\npredictor.base_ms = 1\n'
        '[[workerset]]\nname = "a"\nprofile = "p"\nkv_block_size = 8\ndiscovery.workers_file = "w.toml"\n'
        '[tokenize]\nlocal.mount_dir = "tok"\n'
    )
    config = load_router_config(path)
    assert config.profile[0].tokenize.mode == "compare" and config.profile[0].predictor.base_ms == 1.0
    assert config.tokenize.local.mount_dir == tmp_path / "tok"  # relative to the config file's directory


def test_relative_paths_resolve_against_the_config_files_directory(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    path = write(conf, minimal())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_router_config(Path("..") / "conf" / path.name)
    assert config.workerset[0].discovery.workers_file.resolve() == conf / "w.toml"
    assert config.workerset[0].workers[0].worker_id_str == "w0"


# ---- unknown keys ----------------------------------------------------------------------------------


def test_unknown_top_level_key_is_an_error_listing_the_accepted_keys(tmp_path):
    doc = {**minimal(), "listne": "oops"}
    message = error(tmp_path, doc)
    assert message.startswith(f"{tmp_path / 'router.toml'}: unknown top-level key 'listne'; accepted keys: ")
    accepted = message.split("accepted keys: ")[1].split(", ")
    assert accepted == list(RouterConfig.model_fields)
    assert {"listen", "profile", "workerset", "tokenize", "leader_election", "body_ttl_secs"} <= set(accepted)


def test_unknown_section_is_an_unknown_top_level_key(tmp_path):
    assert "unknown top-level key 'ratelimit'" in error(tmp_path, {**minimal(), "ratelimit": {"enabled": True}})


def test_unknown_keys_inside_sections_and_in_the_workers_file_are_ignored(tmp_path, caplog):
    doc = minimal()
    doc["profile"][0]["predictor"] = {"base_ms": 5, "future_knob": 1}
    doc["workerset"][0]["discovery"]["defaults"] = {"grpc_port": 1}
    doc["workerset"][0]["workers"] = [{"worker_id_str": "from-the-config"}]  # workers come from the file only
    doc["leader_election"] = {"lease_name": "x", "unknown": True}
    doc["tokenize"] = {"local": {"cache": "yes"}}
    workers = [{**WORKER, "gpu": "h200"}]
    with caplog.at_level(logging.DEBUG, logger="kiln.router"):
        config = load(tmp_path, doc, workers)
    assert config.profile[0].predictor.base_ms == 5.0
    assert config.leader_election.lease_name == "x"
    assert [w.worker_id_str for w in config.workerset[0].workers] == ["w0"]
    logged = caplog.text
    for key in ("future_knob", "grpc_port", "unknown", "cache", "gpu", "key workers in [workerset]"):
        assert key in logged
    # and the workers file's own top level tolerates unknown keys
    (tmp_path / "w.toml").write_text('version = 2\n[meta]\nowner = "me"\n' + to_toml({"workers": [WORKER]}))
    assert load_router_config(tmp_path / "router.toml").workerset[0].workers[0].worker_id_num == 0


# ---- rules -----------------------------------------------------------------------------------------


def _set(doc: dict, dotted: str, value) -> dict:
    """doc with dotted (`workerset.0.kv_block_size`) set to value; `...` deletes it."""
    node = doc
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize(
    "dotted, value, expected",
    [
        ("listen", ..., "listen: required"),
        ("workerset.0.kv_block_size", 0, "workerset[0].kv_block_size = 0: must be > 0"),
        ("workerset.0.kv_block_size", -16, "workerset[0].kv_block_size = -16: must be > 0"),
        ("workerset.0.kv_block_size", ..., "workerset[0].kv_block_size: required"),
        ("workerset.0.kv_block_size", "16", 'workerset[0].kv_block_size = "16": expected an integer'),
        ("workerset.0.kv_block_size", 16.0, "workerset[0].kv_block_size = 16.0: expected an integer"),
        ("workerset.0.name", "", 'workerset[0].name = "": must be non-empty'),
        ("workerset.0.profile", "nope", 'workerset[0].profile = "nope": no [[profile]] has this name (defined: p)'),
        ("profile.0.name", "", 'profile[0].name = "": must be non-empty'),
        ("profile.0.name", ..., "profile[0].name: required"),
        ("profile.0.predictor.base_ms", "fast", 'profile[0].predictor.base_ms = "fast": expected a number'),
        ("profile.0.predictor.base_ms", True, "profile[0].predictor.base_ms = true: expected a number"),
        ("profile.0.picker.top_k_min", 2.5, "profile[0].picker.top_k_min = 2.5: expected an integer"),
        ("profile.0.picker.inflight_tracking", "yes", 'inflight_tracking = "yes": expected a boolean'),
        ("profile.0.tokenize.mode", "grpc", "profile[0].tokenize.mode = \"grpc\": expected one of 'render', 'local'"),
        ("dashboard_max_workers", True, "dashboard_max_workers = true: expected an integer"),
        ("metrics_poll_ms", "1000", 'metrics_poll_ms = "1000": expected an integer'),
        ("mock_mode", 1, "mock_mode = 1: expected a boolean"),
        ("listen", 50051, "listen = 50051: expected a string"),
        ("admin_listen", ["a"], 'admin_listen = ["a"]: expected a string'),
        ("tokenize", 3, "tokenize = 3: expected a table"),
        ("profile", {"name": "p"}, 'profile = {"name": "p"}: expected an array of tables ([[profile]])'),
        ("workerset.0.discovery.mode", "dns", 'workerset[0].discovery.mode = "dns": expected one of'),
        (
            "workerset.0.discovery.workers_file",
            ...,
            "workerset[0].discovery.workers_file: required when mode is static",
        ),
        ("workerset.0.discovery.workers_file", 3, "workerset[0].discovery.workers_file = 3: expected a path"),
        ("workerset.0.discovery.workers_file", "", 'workers_file = "": must be a non-empty path'),
        ("workerset.0.discovery.defaults.replay_port", "x", 'discovery.defaults.replay_port = "x": expected an int'),
        ("kubernetes.discovery_defaults.http_port", "80", 'kubernetes.discovery_defaults.http_port = "80": expected'),
        ("kubernetes.selector", "team in a", 'kubernetes.selector = "team in a": cannot read label selector term'),
        ("tokenize.pool_max_idle_per_host", 1.5, "tokenize.pool_max_idle_per_host = 1.5: expected an integer"),
        ("tokenize.local.warmup", "no", 'tokenize.local.warmup = "no": expected a boolean'),
        ("leader_election.lease_name", "", 'leader_election.lease_name = "": must be non-empty'),
        ("leader_election.lease_duration_secs", 0, "leader_election.lease_duration_secs = 0: must be > 0"),
        ("leader_election.renew_grace_secs", 0, "leader_election.renew_grace_secs = 0: must be > 0"),
        ("leader_election.retry_secs", -1, "leader_election.retry_secs = -1: must be > 0"),
        ("leader_election.renew_grace_secs", 15, "renew_grace_secs = 15: must be less than lease_duration_secs (15)"),
        ("token_review.max_cache_entries", "big", 'token_review.max_cache_entries = "big": expected an integer'),
        ("rate_limit.enabled", "true", 'rate_limit.enabled = "true": expected a boolean'),
    ],
)
def test_invalid_values_name_the_file_the_key_and_the_value(tmp_path, dotted, value, expected):
    message = error(tmp_path, _set(minimal(), dotted, value))
    assert message.startswith(f"{tmp_path / 'router.toml'}: ")
    assert expected in message


def test_an_int_is_accepted_for_a_float(tmp_path):
    doc = _set(minimal(), "profile.0.predictor.base_ms", 250)
    value = load(tmp_path, doc).profile[0].predictor.base_ms
    assert value == 250.0 and isinstance(value, float)


def test_every_invalid_value_is_reported_at_once(tmp_path):
    doc = _set(_set(minimal(), "workerset.0.kv_block_size", 0), "metrics_poll_ms", "often")
    lines = error(tmp_path, doc).splitlines()
    assert len(lines) == 2
    assert any("workerset[0].kv_block_size = 0" in line for line in lines)
    assert any('metrics_poll_ms = "often"' in line for line in lines)


def test_names_are_unique(tmp_path):
    doc = minimal()
    doc["profile"].append({"name": "p"})
    assert 'profile[1].name = "p": duplicate name (also profile[0])' in error(tmp_path, doc)
    doc = minimal()
    doc["workerset"].append(dict(doc["workerset"][0]))
    assert 'workerset[1].name = "a": duplicate name (also workerset[0])' in error(tmp_path, doc)


def test_worker_ids_are_unique_across_every_worker_set(tmp_path):
    doc = minimal()
    doc["workerset"].append({"name": "b", "profile": "p", "kv_block_size": 16, "discovery": {"workers_file": "x.toml"}})
    (tmp_path / "x.toml").write_text(to_toml({"workers": [{**WORKER, "worker_id_str": "other"}]}))
    message = error(tmp_path, doc)
    assert message.startswith(f"{tmp_path / 'x.toml'}: workers[0].worker_id_num = 0: duplicate")
    assert 'worker "w0" of worker set "a"' in message
    (tmp_path / "x.toml").write_text(to_toml({"workers": [{**WORKER, "worker_id_num": 1}]}))
    message = error(tmp_path, doc)
    assert message.startswith(f'{tmp_path / "x.toml"}: workers[0].worker_id_str = "w0": duplicate')
    # within one file too
    message = error(tmp_path, minimal(), workers=[WORKER, {**WORKER, "worker_id_str": "w1"}])
    assert f"{tmp_path / 'w.toml'}: workers[1].worker_id_num = 0: duplicate" in message


def test_zmq_endpoint_is_required_unless_mock_mode(tmp_path):
    worker = {k: v for k, v in WORKER.items() if k != "zmq_endpoint"}
    message = error(tmp_path, minimal(), workers=[worker])
    assert message == f"{tmp_path / 'w.toml'}: workers[0].zmq_endpoint: required unless mock_mode = true"
    config = load(tmp_path, {**minimal(), "mock_mode": True}, workers=[worker])
    assert config.workerset[0].workers[0].zmq_endpoint is None


@pytest.mark.parametrize(
    "worker, expected",
    [
        ({"worker_id_num": "7"}, 'workers[0].worker_id_num = "7": expected an integer'),
        ({"worker_id_num": False}, "workers[0].worker_id_num = false: expected an integer"),
        ({"worker_id_str": ""}, 'workers[0].worker_id_str = "": must be non-empty'),
        ({"model_name": ...}, "workers[0].model_name: required"),
        ({"pod_ip": 10}, "workers[0].pod_ip = 10: expected a string"),
        ({"http_url": "10.0.0.5:8000"}, 'workers[0].endpoint: cannot derive endpoint from http_url = "10.0.0.5:8000"'),
    ],
)
def test_invalid_workers_name_the_workers_file(tmp_path, worker, expected):
    w = {**WORKER, **worker}
    w = {k: v for k, v in w.items() if v is not ...}
    message = error(tmp_path, minimal(), workers=[w])
    assert message.startswith(f"{tmp_path / 'w.toml'}: ")
    assert expected in message


def test_workers_file_must_be_an_array_of_tables_and_must_exist(tmp_path):
    (tmp_path / "router.toml").write_text(to_toml(minimal()))
    with pytest.raises(RouterConfigError, match=r"workers_file = .*w\.toml.*: file .* does not exist"):
        load_router_config(tmp_path / "router.toml")
    (tmp_path / "w.toml").write_text("[workers]\nworker_id_str = 'w0'\n")
    with pytest.raises(
        RouterConfigError, match=r"w\.toml: workers = .*: expected an array of tables \(\[\[workers\]\]\)"
    ):
        load_router_config(tmp_path / "router.toml")
    (tmp_path / "w.toml").write_text("[[workers]\n")
    with pytest.raises(RouterConfigError, match=r"w\.toml: not valid TOML"):
        load_router_config(tmp_path / "router.toml")


def test_config_file_errors(tmp_path):
    with pytest.raises(RouterConfigError, match="config file .*nope.toml does not exist"):
        load_router_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("listen = \n")
    with pytest.raises(RouterConfigError, match=r"bad\.toml: not valid TOML"):
        load_router_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    "http_url, endpoint",
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000"),
        ("http://10.0.0.5:8000/", "10.0.0.5:8000"),
        ("http://worker-0.llm.svc:8000/v1", "worker-0.llm.svc:8000"),
        ("http://worker-0", "worker-0:80"),
        ("https://worker-0", "worker-0:443"),
        ("http://[fd00::5]:8000", "[fd00::5]:8000"),
    ],
)
def test_endpoint_is_derived_from_http_url(tmp_path, http_url, endpoint):
    assert endpoint_from_url(http_url) == endpoint
    config = load(tmp_path, minimal(), workers=[{**WORKER, "http_url": http_url}])
    assert config.workerset[0].workers[0].endpoint == endpoint


def test_an_explicit_endpoint_wins_and_no_http_url_leaves_it_unset(tmp_path):
    workers = [
        {**WORKER, "http_url": "http://10.0.0.5:8000", "endpoint": "public.example:443"},
        {**WORKER, "worker_id_str": "w1", "worker_id_num": 1},
    ]
    got = load(tmp_path, minimal(), workers=workers).workerset[0].workers
    assert [w.endpoint for w in got] == ["public.example:443", None]


@pytest.mark.parametrize("bad", ["ftp://host:21", "http://", "http://host:notaport"])
def test_an_endpoint_cannot_be_derived_from_a_bad_url(bad):
    with pytest.raises(ValueError, match="cannot derive endpoint"):
        endpoint_from_url(bad)


def test_http_is_an_alias_of_render(tmp_path):
    doc = _set(minimal(), "profile.0.tokenize.mode", "http")
    assert load(tmp_path, doc).profile[0].tokenize.mode == "render"


@pytest.mark.parametrize("value, expected", [("none", "none"), ("all", "all"), (["a", "b"], ("a", "b")), ([], ())])
def test_tenant_labels_forms(tmp_path, value, expected):
    assert load(tmp_path, _set(minimal(), "metrics.tenant_labels", value)).metrics.tenant_labels == expected


@pytest.mark.parametrize("value", ["some", "None", 3, True, ["a", 1], {"a": "b"}])
def test_tenant_labels_other_values_are_errors(tmp_path, value):
    message = error(tmp_path, _set(minimal(), "metrics.tenant_labels", value))
    assert f'metrics.tenant_labels = {json.dumps(value)}: expected "none", "all" or a list of strings' in message


def test_discovery_modes(tmp_path):
    doc = _set(minimal(), "workerset.0.discovery", {"mode": "kubernetes"})
    assert "workerset[0].discovery.service_name: required when mode is kubernetes" in error(tmp_path, doc)
    doc = _set(minimal(), "workerset.0.discovery", {"mode": "kubernetes", "service_name": "llm"})
    ws = load(tmp_path, doc).workerset[0]
    assert ws.discovery.service_name == "llm" and ws.discovery.namespace is None and ws.workers == ()


def test_a_worker_set_is_required_unless_kubernetes_is_enabled(tmp_path):
    doc = {k: v for k, v in minimal().items() if k != "workerset"}
    assert "workerset: at least one [[workerset]] is required unless [kubernetes] enabled = true" in error(
        tmp_path, doc
    )
    assert load(tmp_path, {**doc, "kubernetes": {"enabled": True}}).workerset == ()
    doc = {"listen": "x", "kubernetes": {"enabled": True}}
    assert "kubernetes.enabled = true: needs at least one [[profile]]" in error(tmp_path, doc)


def test_token_review_needs_kubernetes_credentials(tmp_path, monkeypatch):
    doc = {**minimal(), "token_review": {"enabled": True}}
    assert "token_review.enabled = true: no Kubernetes credentials" in error(tmp_path, doc)
    # ~/.kube/config
    kubeconfig = tmp_path / "home" / ".kube" / "config"
    kubeconfig.parent.mkdir(parents=True)
    kubeconfig.write_text("apiVersion: v1\n")
    assert load(tmp_path, doc).token_review.enabled
    # KUBECONFIG names the files to use instead (the first one present counts)
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{tmp_path / 'kc'}")
    assert "no Kubernetes credentials" in error(tmp_path, doc)
    (tmp_path / "kc").write_text("apiVersion: v1\n")
    assert load(tmp_path, doc).token_review.enabled
    # in a cluster: the service host and a service account token
    monkeypatch.delenv("KUBECONFIG")
    kubeconfig.unlink()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert "no Kubernetes credentials" in error(tmp_path, doc)
    (tmp_path / "no-token").write_text("token")
    assert load(tmp_path, doc).token_review.enabled


def test_rate_limit_warns_that_it_admits_everything(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.router"):
        load(tmp_path, minimal())
        assert not caplog.records
        load(tmp_path, {**minimal(), "rate_limit": {"enabled": True}})
    [record] = caplog.records
    assert record.name == "kiln.router" and record.levelno == logging.WARNING
    assert "admits every reservation and tracks no budget" in record.getMessage()


# ---- the example, the CLI, imports -----------------------------------------------------------------


def test_the_example_configuration_loads():
    config = load_router_config(ROOT / "server" / "router.example.toml")
    assert [w.endpoint for w in config.workerset[0].workers] == ["10.0.0.5:8000", "10.0.0.6:8000"]
    # it shows every default: only the required keys and the workers differ from a minimal config's
    defaults = {k: v for k, v in config.to_json().items() if k not in ("listen", "profile", "workerset")}
    assert defaults == TOP_DEFAULTS
    profile = config.to_json()["profile"][0]
    assert profile["predictor"] == PREDICTOR_DEFAULTS and profile["picker"] == PICKER_DEFAULTS
    assert config.workerset[0].discovery.defaults.model_dump() == PORT_DEFAULTS


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_python_m_kiln_router_check(tmp_path):
    path = write(tmp_path, minimal())
    proc = _run("-m", "kiln.router", "--config", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == load_router_config(path).to_json()

    bad = write(tmp_path, _set(minimal(), "workerset.0.kv_block_size", 0), name="bad.toml")
    proc = _run("-m", "kiln.router", "--config", str(bad), "--check")
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{bad}: workerset[0].kv_block_size = 0: must be > 0" in proc.stderr

    # without --check the router serves: tests/router/test_router_server.py


def test_kiln_router_subcommand(tmp_path, capsys):
    from kiln.cli import main

    path = write(tmp_path, minimal())
    assert main(["router", "--config", str(path), "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["workerset"][0]["name"] == "a"
    assert main(["router", "--config", str(tmp_path / "missing.toml"), "--check"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["router", "--config", str(tmp_path / "missing.toml")]) == 2  # serving checks it alike


def test_the_router_imports_no_model_code(tmp_path):
    path = write(tmp_path, minimal())
    code = (
        "import sys\n"
        "import kiln.router.config, kiln.router.__main__\n"
        "import kiln.router.ingest, kiln.router.kv_index, kiln.router.kv_wire\n"
        "import kiln.router.core, kiln.router.grpc_api, kiln.router.admin, kiln.router.serve\n"
        "import kiln.router.bodies, kiln.router.bookkeeping, kiln.router.metrics, kiln.router.dashboard\n"
        "import kiln.router.scrape, kiln.router.tokenization, kiln.router.proto.router_pb2_grpc\n"
        "import kiln.router.k8s, kiln.router.leader, kiln.router.token_review\n"
        "from kiln.cli import main\n"
        f"assert main(['router', '--config', {str(path)!r}, '--check']) == 0\n"
        "heavy = ('jax', 'kiln.engine', 'kiln.models', 'kiln.server', 'kiln.eval.api', 'kiln.eval.service',\n"
        "         'kiln.graders')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith(heavy))\n"
        "assert not loaded, loaded\n"
        "router = sorted(m for m in sys.modules if m.startswith('kiln.router'))\n"
        "print(router, file=sys.stderr)\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "kiln.router.config" in proc.stderr
