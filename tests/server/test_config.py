"""Configuration resolution, serving profiles and error bodies, through `python -m kiln config`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import (
    AdmissionRejected,
    DeviceLost,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RequestFailed,
    Unauthorized,
    UnprocessableRequest,
)
from kiln.kernels import cpu as kernels

ROOT = Path(__file__).resolve().parents[2]

# The spec's serving_profile objects, written out in full.
SPEC_STABLE = {
    "profile": "stable",
    "source": "default",
    "immutable_after_startup": True,
    "request_overrides_allowed": False,
    "effective_policy_source": "serving_profile",
    "effective_policy": {
        "inference_admission": True,
        "training_gpu_ownership": True,
        "adapter_weight_transitions": True,
        "dynamic_kv_resize": True,
        "allocator_reclaim": True,
        "live_graph_capture": True,
        "vulkan_resident_prefill": False,
        "exclusive_gpu_behavior": "writer_priority",
    },
}
SPEC_EXPERIMENTAL = {
    "profile": "experimental",
    "source": "config_file",
    "immutable_after_startup": True,
    "request_overrides_allowed": False,
    "effective_policy_source": "serving_profile",
    "effective_policy": {
        "inference_admission": True, "training_gpu_ownership": True, "adapter_weight_transitions": True,
        "dynamic_kv_resize": True, "allocator_reclaim": True, "live_graph_capture": True,
        "vulkan_resident_prefill": True, "exclusive_gpu_behavior": "writer_priority",
    },
}
SPEC_MAINTENANCE = {
    "profile": "maintenance",
    "source": "environment",
    "immutable_after_startup": True,
    "request_overrides_allowed": False,
    "effective_policy_source": "serving_profile",
    "effective_policy": {
        "inference_admission": False, "training_gpu_ownership": True, "adapter_weight_transitions": True,
        "dynamic_kv_resize": True, "allocator_reclaim": True, "live_graph_capture": False,
        "vulkan_resident_prefill": False, "exclusive_gpu_behavior": "inference_disabled",
    },
}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """One cache home for the module's `kiln config` runs: the first records the default model's format
    (parsing its GGUF file takes seconds), the others read it."""
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture
def kiln(tmp_path, cache_home):
    """Run `python -m kiln config ...` with no KILN_* variables and a private HOME."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    base.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(cache_home))

    def run(*args: str, env: dict[str, str] | None = None, check: bool = True):
        proc = subprocess.run(
            [sys.executable, "-m", "kiln", "config", *args],
            cwd=ROOT,
            env={**base, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    return run


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(text)
    return path


def resolved(kiln, *args: str, env: dict[str, str] | None = None) -> dict:
    return json.loads(kiln("--json", *args, env=env).stdout)


def fails(kiln, *args: str, env: dict[str, str] | None = None) -> str:
    proc = kiln("--json", *args, env=env, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_defaults_have_source_default(kiln):
    doc = resolved(kiln)
    assert doc["config_file"] is None
    assert list(doc["settings"]) == ["server", "model", "engine", "adapters", "train", "distributed", "cache",
                                     "backend", "debug"]
    assert doc["settings"]["server"]["port"] == {"value": 8000, "source": "default"}
    assert doc["settings"]["server"]["host"] == {"value": "127.0.0.1", "source": "default"}
    assert doc["settings"]["engine"]["decode_row_buckets"]["value"] == [1, 2, 4, 8, 16, 32]
    assert doc["settings"]["engine"]["enable_prefix_caching"]["value"] is True
    assert all(v["source"] == "default" for sec in doc["settings"].values() for v in sec.values())
    assert doc["serving_profile"] == SPEC_STABLE
    # the default model's layers are Q4_1: auto holds them as int4, as stored
    assert doc["model"]["quantization"] == {"value": "int4", "source": "auto: the GGUF file's layers are Q4_1"}


def test_config_names_the_weights_format_and_why(kiln):
    asked = resolved(kiln, env={"KILN_MODEL_QUANTIZATION": "int8"})["model"]["quantization"]
    assert asked == {"value": "int8", "source": "[model] quantization"}
    missing = resolved(kiln, env={"KILN_MODEL_PATH": "/nowhere/model.gguf"})["model"]["quantization"]
    assert missing["value"] is None and missing["source"].startswith("unresolved: GGUF file not found")


def test_config_file_values(kiln, tmp_path):
    path = write(
        tmp_path,
        '[server]\nport = 9001\napi_keys = ["a", "b"]\n'
        '[engine]\nenable_prefix_caching = false\ndecode_row_buckets = [1, 4]\n'
        '[model]\ndtype = "bfloat16"\n',
    )
    doc = resolved(kiln, "--config", str(path))
    s = doc["settings"]
    assert doc["config_file"] == str(path)
    assert s["server"]["port"] == {"value": 9001, "source": "config_file"}
    assert s["server"]["api_keys"] == {"value": ["<redacted>", "<redacted>"], "source": "config_file"}
    assert s["engine"]["enable_prefix_caching"] == {"value": False, "source": "config_file"}
    assert s["engine"]["decode_row_buckets"] == {"value": [1, 4], "source": "config_file"}
    assert s["model"]["dtype"] == {"value": "bfloat16", "source": "config_file"}
    assert s["server"]["host"]["source"] == "default"


def test_environment_beats_file_and_command_line_beats_environment(kiln, tmp_path):
    path = write(tmp_path, '[server]\nport = 9001\nhost = "0.0.0.0"\n[cache]\ndir = "/from/file"\n')
    env = {
        "KILN_SERVER_PORT": "9002",
        "KILN_CACHE_DIR": "/from/env",
        "KILN_ENGINE_ENABLE_PREFIX_CACHING": "No",
        "KILN_ENGINE_PREFILL_TOKEN_BUCKETS": "8, 64",
        "KILN_SERVER_API_KEYS": "k1,k2",
        "KILN_SOMETHING_UNKNOWN": "ignored",
    }
    s = resolved(kiln, "--config", str(path), env=env)["settings"]
    assert s["server"]["port"] == {"value": 9002, "source": "environment"}
    assert s["server"]["host"] == {"value": "0.0.0.0", "source": "config_file"}
    assert s["cache"]["dir"] == {"value": "/from/env", "source": "environment"}
    assert s["engine"]["enable_prefix_caching"] == {"value": False, "source": "environment"}
    assert s["engine"]["prefill_token_buckets"] == {"value": [8, 64], "source": "environment"}
    assert s["server"]["api_keys"]["value"] == ["<redacted>"] * 2

    s = resolved(kiln, "--config", str(path), "--port", "9003", "--model", "/m", env=env)["settings"]
    assert s["server"]["port"] == {"value": 9003, "source": "command_line"}
    assert s["model"]["path"] == {"value": "/m", "source": "command_line"}


def test_tensor_parallel_takes_a_count_or_auto(kiln, tmp_path):
    assert resolved(kiln)["settings"]["engine"]["tensor_parallel"] == {"value": 1, "source": "default"}
    s = resolved(kiln, "--config", str(write(tmp_path, '[engine]\ntensor_parallel = "Auto"\n')))["settings"]
    assert s["engine"]["tensor_parallel"] == {"value": "auto", "source": "config_file"}
    s = resolved(kiln, "--config", str(write(tmp_path, "[engine]\ntensor_parallel = 2\n")))["settings"]
    assert s["engine"]["tensor_parallel"] == {"value": 2, "source": "config_file"}
    s = resolved(kiln, env={"KILN_ENGINE_TENSOR_PARALLEL": " 4"})["settings"]
    assert s["engine"]["tensor_parallel"] == {"value": 4, "source": "environment"}


def test_the_resolved_mesh_and_attention_kernel_are_shown(kiln):
    """The devices a server and a training run would use, from the settings and this process's devices."""
    four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    compiler = kernels.compiler() is not None  # Kiln's CPU kernels build
    assert resolved(kiln)["mesh"] == {"serving": {"axis": None, "size": 1, "devices": []},
                                      "training": {"data_parallel": 1, "tensor_parallel": 1, "devices": []},
                                      "attention": "cpu" if compiler else "xla"}
    assert resolved(kiln, env={"KILN_ENGINE_CPU_KERNELS": "off"})["mesh"]["attention"] == "xla"
    assert resolved(kiln, env={**four, "KILN_ENGINE_TENSOR_PARALLEL": "2"})["mesh"]["attention"] == "xla"
    mesh = resolved(kiln, env={**four, "KILN_ENGINE_TENSOR_PARALLEL": "2", "KILN_TRAIN_DATA_PARALLEL": "auto",
                               "KILN_ENGINE_ATTENTION": "pallas"})["mesh"]
    assert mesh["serving"] == {"axis": "tp", "size": 2, "devices": ["cpu:0", "cpu:1"]}
    assert mesh["training"] == {"data_parallel": 2, "tensor_parallel": 2,
                                "devices": ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]}
    assert mesh["attention"] == "pallas"
    # more devices than there are: the settings are valid, the mesh says why it cannot be made
    mesh = resolved(kiln, env={**four, "KILN_ENGINE_TENSOR_PARALLEL": "8"})["mesh"]
    assert mesh == {"error": "engine.tensor_parallel = 8, but this process has 4 local cpu device(s)"}
    # a mesh that does not divide the devices
    mesh = resolved(kiln, env={**four, "KILN_ENGINE_TENSOR_PARALLEL": "3"})["mesh"]
    assert mesh == {"error": "engine.tensor_parallel = 3 does not divide the 4 local cpu devices found"}
    mesh = resolved(kiln, env={**four, "KILN_TRAIN_DATA_PARALLEL": "3"})["mesh"]
    assert mesh == {"error": "train.data_parallel = 3 times engine.tensor_parallel = 1 (3 devices) does not divide "
                             "the 4 cpu devices found"}


def test_profile_from_environment_is_normalized(kiln):
    doc = resolved(kiln, env={"KILN_SERVER_SERVING_PROFILE": " MAINTENANCE "})
    assert doc["settings"]["server"]["serving_profile"] == {"value": "maintenance", "source": "environment"}
    assert doc["serving_profile"] == SPEC_MAINTENANCE


def test_profile_from_config_file(kiln, tmp_path):
    path = write(tmp_path, '[server]\nserving_profile = "Experimental"\n')
    assert resolved(kiln, "--config", str(path))["serving_profile"] == SPEC_EXPERIMENTAL


@pytest.mark.parametrize("raw", ["", "  ", "turbo"])
def test_bad_profile_in_environment_is_fatal(kiln, raw):
    err = fails(kiln, env={"KILN_SERVER_SERVING_PROFILE": raw})
    assert "KILN_SERVER_SERVING_PROFILE" in err and repr(raw) in err


@pytest.mark.parametrize("raw", ["", "turbo"])
def test_bad_profile_in_config_file_is_fatal(kiln, tmp_path, raw):
    path = write(tmp_path, f'[server]\nserving_profile = "{raw}"\n')
    err = fails(kiln, "--config", str(path))
    assert str(path) in err and "serving_profile" in err and repr(raw) in err


def test_retired_profile_variable_is_ignored_with_warning(kiln):
    proc = kiln("--json", env={"KILN_SERVING_PROFILE": "maintenance"})
    doc = json.loads(proc.stdout)
    assert doc["serving_profile"] == SPEC_STABLE
    assert "KILN_SERVING_PROFILE" in proc.stderr and "KILN_SERVER_SERVING_PROFILE" in proc.stderr
    assert "WARNING kiln.config" in proc.stderr


def test_unknown_key_lists_accepted_keys(kiln, tmp_path):
    path = write(tmp_path, "[server]\nprot = 1\n")
    err = fails(kiln, "--config", str(path))
    assert str(path) in err and "'prot'" in err
    assert "accepted keys: host, port, serving_profile, api_keys" in err


def test_unknown_section_lists_accepted_sections(kiln, tmp_path):
    path = write(tmp_path, "[sever]\nport = 1\n")
    err = fails(kiln, "--config", str(path))
    assert "[sever]" in err and "accepted sections: server, model, engine, adapters, train, distributed, cache" in err


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"KILN_SERVER_PORT": "eighty"}, "KILN_SERVER_PORT: invalid value 'eighty'"),
        ({"KILN_SERVER_PORT": "0"}, "KILN_SERVER_PORT: invalid value '0'"),
        ({"KILN_SERVER_PORT": "65536"}, "KILN_SERVER_PORT: invalid value '65536'"),
        ({"KILN_ENGINE_ENABLE_PREFIX_CACHING": "maybe"}, "KILN_ENGINE_ENABLE_PREFIX_CACHING: invalid value 'maybe'"),
        ({"KILN_ENGINE_BLOCK_SIZE": "24"}, "KILN_ENGINE_BLOCK_SIZE: invalid value '24'"),
        ({"KILN_ENGINE_DECODE_ROW_BUCKETS": "1,x"}, "KILN_ENGINE_DECODE_ROW_BUCKETS: invalid value '1,x'"),
        ({"KILN_SERVER_LOG_LEVEL": "loud"}, "KILN_SERVER_LOG_LEVEL: invalid value 'loud'"),
        ({"KILN_TRAIN_MAX_SLICE_MS": "0"}, "KILN_TRAIN_MAX_SLICE_MS: invalid value '0'"),
        ({"KILN_ENGINE_TENSOR_PARALLEL": "two"},
         "KILN_ENGINE_TENSOR_PARALLEL: invalid value 'two' for engine.tensor_parallel: expected an integer or "
         '"auto"'),
        ({"KILN_ENGINE_TENSOR_PARALLEL": "0"},
         "invalid value '0' for engine.tensor_parallel: expected auto or an integer >= 1"),
        ({"KILN_DISTRIBUTED_PROCESS_ID": "-1"},
         "invalid value '-1' for distributed.process_id: expected auto or an integer >= 0"),
        ({"KILN_DISTRIBUTED_NUM_PROCESSES": "0"}, "KILN_DISTRIBUTED_NUM_PROCESSES: invalid value '0'"),
    ],
)
def test_invalid_environment_values_are_fatal(kiln, env, needle):
    assert needle in fails(kiln, env=env)


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[server]\nport = "8000"\n', "invalid value '8000' for server.port"),
        ("[server]\nport = 70000\n", "invalid value 70000 for server.port"),
        ('[engine]\nenable_prefix_caching = "yes"\n', "invalid value 'yes' for engine.enable_prefix_caching"),
        ("[engine]\nmax_num_seqs = true\n", "invalid value True for engine.max_num_seqs"),
        ("[server]\ndrain_timeout_s = -1\n", "invalid value -1 for server.drain_timeout_s: expected a number >= 0"),
        ('[engine]\nasync_scheduling = "sometimes"\n', "invalid value 'sometimes' for engine.async_scheduling"),
        ("[train]\nmax_slice_ms = -5\n", "invalid value -5 for train.max_slice_ms: expected a number > 0"),
        ('[engine]\ntensor_parallel = "all"\n', "invalid value 'all' for engine.tensor_parallel"),
        ("[engine]\ntensor_parallel = 1.5\n", "invalid value 1.5 for engine.tensor_parallel"),
        ("[distributed]\ntimeout_s = 0\n", "invalid value 0 for distributed.timeout_s"),
    ],
)
def test_invalid_file_values_are_fatal(kiln, tmp_path, text, needle):
    path = write(tmp_path, text)
    err = fails(kiln, "--config", str(path))
    assert str(path) in err and needle in err


def test_port_out_of_range_on_command_line(kiln):
    assert "--port: invalid value '0'" in fails(kiln, "--port", "0")


def test_missing_and_invalid_config_file(kiln, tmp_path):
    missing = tmp_path / "nope.toml"
    err = fails(kiln, "--config", str(missing))
    assert str(missing) in err and "does not exist" in err
    bad = write(tmp_path, "[server\nport = 1\n")
    assert "not valid TOML" in fails(kiln, "--config", str(bad))


def test_human_readable_output(kiln):
    out = kiln(env={"KILN_SERVER_PORT": "9100"}).stdout
    assert "port = 9100" in out and "environment KILN_SERVER_PORT" in out
    assert "serving profile: stable (source: default)" in out
    assert "exclusive_gpu_behavior=writer_priority" in out


@pytest.mark.parametrize(
    "err, status, type_, code",
    [
        (InvalidRequest("m", param="temperature"), 400, "invalid_request_error", None),
        (UnprocessableRequest("m"), 422, "invalid_request_error", None),
        (Unauthorized("m"), 401, "authentication_error", "invalid_api_key"),
        (NotFound("m", code="model_not_found"), 404, "not_found_error", "model_not_found"),
        (PayloadTooLarge("m"), 413, "invalid_request_error", "payload_too_large"),
        (QueueFull("m"), 429, "rate_limit_error", "queue_full"),
        (AdmissionRejected("m", code="inference_disabled_by_profile"), 503, "service_unavailable",
         "inference_disabled_by_profile"),
        (RequestFailed("m"), 500, "internal_error", None),
        (DeviceLost("m"), 503, "service_unavailable", "device_lost"),
    ],
)
def test_error_bodies(err, status, type_, code):
    assert err.status == status
    assert err.body() == {"error": {"message": "m", "type": type_, "code": code, "param": err.param}}


def test_settings_api_in_process(tmp_path):
    from kiln.config import resolve_settings
    from kiln.errors import ConfigError
    from kiln.profiles import ServingProfile, parse_profile

    s = resolve_settings(env={"KILN_SERVER_SERVING_PROFILE": "maintenance", "XDG_CACHE_HOME": str(tmp_path)})
    assert (s.server.port, s.source("server.port"), s.get("engine.block_size")) == (8000, "default", 16)
    assert s.serving_profile.profile is ServingProfile.MAINTENANCE
    assert not s.serving_profile.policy.inference_admission
    assert s.cache_dir() == tmp_path / "kiln" and s.compilation_dir() == tmp_path / "kiln" / "jax"
    with pytest.raises(ConfigError, match="somewhere: invalid value 'x'"):
        parse_profile("x", "somewhere")


def test_config_shows_the_backend_route_and_why(kiln, tmp_path):
    """`kiln config` names the route `kiln serve` would take and the reason; a route asked for that
    cannot run here is shown unavailable with its install hint (serve would stop on it)."""
    doc = json.loads(kiln("--json").stdout)
    assert doc["backend"]["available"] and doc["backend"]["route"] in ("xla", "vulkan")
    assert doc["backend"]["reason"].startswith("auto: ")
    nowhere = str(tmp_path / "none.json")
    env = {"KILN_BACKEND_ROUTE": "vulkan", "VK_ICD_FILENAMES": nowhere, "VK_DRIVER_FILES": nowhere}
    doc = json.loads(kiln("--json", env=env).stdout)
    assert doc["backend"]["route"] == "vulkan" and doc["backend"]["available"] is False
    assert "route vulkan" in doc["backend"]["reason"]
    assert "backend route: vulkan (unavailable: route vulkan" in kiln(env=env).stdout


def test_only_the_commands_that_serve_take_the_server_address():
    def help_of(*command: str) -> str:
        return subprocess.run([sys.executable, "-m", "kiln", *command, "--help"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT).stdout

    assert "--port" in help_of("serve") and "--host" in help_of("config")
    for command in (("warmup",), ("train", "sft"), ("eval", "run"), ("adapters", "list")):
        text = help_of(*command)
        assert "--config" in text and "--port" not in text and "--host" not in text, command
