"""The router's Kubernetes API client: a lightkube AsyncClient built from the pod's service account
(in a cluster) or from a kubeconfig (KUBECONFIG, else ~/.kube/config), and readable messages for
what can go wrong talking to the API server.

Leader election (leader.py) and TokenReview (token_review.py) share one client.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import httpx2
from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig

from kiln.router.config import SERVICE_ACCOUNT_TOKEN

# Each API call gives up after this long; callers with a tighter deadline wrap calls in their own.
REQUEST_TIMEOUT_S = 10.0
# how long stopping a task that talks to the API server waits for it to end after its cancel
STOP_TIMEOUT_S = 5.0

log = logging.getLogger("kiln.router")


class KubernetesError(Exception):
    """The client cannot be built (no or unreadable credentials); fatal at startup."""


def load_kube_config(env: Mapping[str, str] | None = None) -> KubeConfig:
    """In a cluster the service account; otherwise the first existing KUBECONFIG file, else ~/.kube/config."""
    env = os.environ if env is None else env
    try:
        if env.get("KUBERNETES_SERVICE_HOST") and SERVICE_ACCOUNT_TOKEN.is_file():
            return KubeConfig.from_service_account(SERVICE_ACCOUNT_TOKEN.parent)
        if env.get("KUBECONFIG"):
            files = [Path(p).expanduser() for p in env["KUBECONFIG"].split(os.pathsep) if p]
            path = next((p for p in files if p.is_file()), None)
            if path is None:
                raise KubernetesError(f"KUBECONFIG = {env['KUBECONFIG']!r}: no such file")
        else:
            path = Path(env.get("HOME", "~")).expanduser() / ".kube" / "config"
            if not path.is_file():
                raise KubernetesError(
                    "no Kubernetes credentials: not in a cluster (KUBERNETES_SERVICE_HOST and a service account "
                    f"token) and no kubeconfig (KUBECONFIG or {path})"
                )
        config = KubeConfig.from_file(path)
        config.get()  # fails here, not on the first call, when there is no usable context
        return config
    except ConfigError as e:
        raise KubernetesError(f"cannot load Kubernetes credentials: {e}") from None
    except KubernetesError:
        raise
    except Exception as e:  # unreadable or malformed kubeconfig (OSError, YAML errors, missing keys)
        raise KubernetesError(f"cannot load the kubeconfig: {type(e).__name__}: {e}") from None


def make_client(config: KubeConfig | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> AsyncClient:
    """An AsyncClient on `config` (default: load_kube_config()); raises KubernetesError."""
    config = load_kube_config() if config is None else config
    try:
        return AsyncClient(config, timeout=httpx2.Timeout(timeout_s), trust_env=False)
    except (ConfigError, OSError, ValueError) as e:
        raise KubernetesError(f"cannot build the Kubernetes client: {e}") from None


def own_namespace(client: AsyncClient, env: Mapping[str, str] | None = None) -> str:
    """The router's namespace: POD_NAMESPACE (the manifest sets it), else the service account's namespace
    or the kubeconfig context's, else "default" (lightkube's choice)."""
    env = os.environ if env is None else env
    return env.get("POD_NAMESPACE") or client.namespace


def server_of(client: AsyncClient) -> str:
    try:
        return client.config.cluster.server
    except Exception:  # a lazily loaded config that cannot load
        return "the Kubernetes API server"


def describe_error(error: BaseException, client: AsyncClient | None = None) -> str:
    """One line: denied (401/403, with a hint), another API status, unreachable or timed out."""
    where = server_of(client) if client is not None else "the Kubernetes API server"
    if isinstance(error, ApiError):
        status = error.status
        code, reason, message = status.code, status.reason or "", status.message or ""
        if code in (401, 403):
            return f"denied by {where} ({code} {reason}): {message}; check the router's credentials and RBAC"
        return f"{where} answered {code} {reason}: {message}".rstrip(": ")
    if isinstance(error, TimeoutError | httpx2.TimeoutException):
        return f"{where} did not answer in time"
    if isinstance(error, httpx2.HTTPError | OSError):
        return f"cannot reach {where}: {type(error).__name__}: {error}"
    return f"Kubernetes API call failed: {type(error).__name__}: {error}"


async def stop_api_task(task: asyncio.Task, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Cancels a task that talks to the API server and waits for it to end, at most `timeout_s`:
    closing a cancelled watch stream can wait on a connection that never answers, and a stop
    (a shutdown, a removed worker set) must not wait with it."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("%s did not end within %.0f s of its cancel; left to end on its own", task.get_name(), timeout_s)
    elif not task.cancelled():
        task.result()  # what the task ended with, raised as awaiting it would
