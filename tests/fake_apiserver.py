"""A small in-process stand-in for the Kubernetes API server, for the router's tests.

It is a real HTTP server (a ThreadingHTTPServer on loopback) speaking just enough of the REST API:

- an in-memory object store keyed by (api path, namespace, plural, name), e.g.
  ("apis/coordination.k8s.io/v1", "kiln", "leases", "kiln-router"), with one resourceVersion
  counter: GET (one or a list), POST (409 AlreadyExists), PUT (409 Conflict when
  metadata.resourceVersion is stale, 404 when absent) and DELETE. Any namespaced or cluster-scoped
  plural works, so later tests can store EndpointSlices, Pods or custom resources the same way;
  there is no watch yet.
- TokenReviews (POST /apis/authentication.k8s.io/v1/tokenreviews), answered from `tokens`, which
  the test fills, counted in `token_reviews`, slowed by `token_review_delay_s`.

Every request must carry the bearer token of the kubeconfig that `write_kubeconfig` writes;
`unavailable = True` answers 503 to everything (an apiserver that is down but listening).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

BEARER = "fake-apiserver-token"
TOKEN_REVIEWS = "apis/authentication.k8s.io/v1"

# /api/v1/... or /apis/{group}/{version}/..., then namespaces/{ns}/ or not, then {plural}[/{name}]
_PATH = re.compile(
    r"^/(?P<api>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?/?$"
)


@dataclass
class User:
    username: str
    uid: str = ""
    groups: list[str] = field(default_factory=list)
    audiences: list[str] | None = None  # None: any audience


class FakeApiServer:
    """`with FakeApiServer() as api:` serves on 127.0.0.1 (`api.url`) until the block ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.resource_version = 0
        self.tokens: dict[str, User] = {}
        self.token_reviews = 0
        self.token_review_delay_s = 0.0
        self.unavailable = False
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def write_kubeconfig(self, path: Path, namespace: str | None = "kiln") -> Path:
        """A kubeconfig whose current context points at this server (plain http, token auth)."""
        context = {"cluster": "fake", "user": "fake", **({"namespace": namespace} if namespace else {})}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": BEARER}}],
            "contexts": [{"name": "fake", "context": context}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(doc))  # JSON is YAML
        return path

    # ---- the store ----------------------------------------------------------------------------

    def get(self, api: str, namespace: str, plural: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((api, namespace, plural, name))
            return json.loads(json.dumps(obj)) if obj is not None else None

    def put(self, api: str, namespace: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store (create or overwrite) an object as a test sets it up, with a new resourceVersion."""
        with self.lock:
            return self._store(api, namespace, plural, obj)

    def _store(self, api: str, namespace: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.resource_version += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.resource_version)
        if namespace:
            meta["namespace"] = namespace
        self.objects[(api, namespace, plural, meta["name"])] = obj
        return json.loads(json.dumps(obj))

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        self.requests.append((method, path))
        if self.unavailable:
            return _status(503, "ServiceUnavailable", "the fake apiserver is unavailable")
        m = _PATH.match(path)
        if m is None:
            return _status(404, "NotFound", f"no route for {path}")
        api, ns, plural, name = m["api"], m["ns"] or "", m["plural"], m["name"]
        if (api, plural) == (TOKEN_REVIEWS, "tokenreviews") and method == "POST":
            return 201, self._review(body or {})
        with self.lock:
            key = (api, ns, plural, name or "")
            current = self.objects.get(key)
            if method == "GET" and name is None:
                items = [o for (a, n, p, _), o in sorted(self.objects.items()) if (a, p) == (api, plural)]
                items = [o for o in items if not ns or o["metadata"].get("namespace") == ns]
                kind = (items[0]["kind"] + "List") if items else "List"
                meta = {"resourceVersion": str(self.resource_version)}
                return 200, {"apiVersion": api.removeprefix("apis/"), "kind": kind, "metadata": meta, "items": items}
            if method == "GET":
                return (200, current) if current is not None else _not_found(plural, name)
            if method == "POST" and name is None and body is not None:
                key = (api, ns, plural, body.get("metadata", {}).get("name", ""))
                if key in self.objects:
                    return _status(409, "AlreadyExists", f'{plural} "{key[3]}" already exists')
                body.setdefault("metadata", {})["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ")
                return 201, self._store(api, ns, plural, body)
            if method == "PUT" and name is not None and body is not None:
                if current is None:
                    return _not_found(plural, name)
                sent = body.get("metadata", {}).get("resourceVersion")
                if sent and sent != current["metadata"]["resourceVersion"]:
                    message = (
                        f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
                        "please apply your changes to the latest version and try again"
                    )
                    return _status(409, "Conflict", message)
                return 200, self._store(api, ns, plural, body)
            if method == "DELETE" and name is not None:
                if self.objects.pop(key, None) is None:
                    return _not_found(plural, name)
                return _status(200, "", "deleted", status="Success")
        return _status(405, "MethodNotAllowed", f"{method} {path} is not supported by the fake")

    def _review(self, review: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.token_reviews += 1
            delay = self.token_review_delay_s
        if delay:
            time.sleep(delay)
        spec = review.get("spec", {})
        user = self.tokens.get(spec.get("token", ""))
        wanted = spec.get("audiences") or []
        if user is None:
            status = {"authenticated": False, "error": "invalid bearer token"}
        elif user.audiences is not None and wanted and not set(wanted) & set(user.audiences):
            status = {"authenticated": False, "error": "token audiences don't match"}
        else:
            info = {"username": user.username, "uid": user.uid, "groups": user.groups}
            status = {"authenticated": True, "user": info, "audiences": wanted}
        return {**review, "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}


def _status(code: int, reason: str, message: str, status: str = "Failure") -> tuple[int, dict[str, Any]]:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": status, "message": message, "code": code}
    if reason:
        body["reason"] = reason
    return code, body


def _not_found(plural: str, name: str) -> tuple[int, dict[str, Any]]:
    return _status(404, "NotFound", f'{plural} "{name}" not found')


def _handler(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients expect

        def log_message(self, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.headers.get("Authorization") != f"Bearer {BEARER}":
                code, body = _status(401, "Unauthorized", "Unauthorized")
            else:
                try:
                    code, body = api.handle(self.command, urlsplit(self.path).path, json.loads(raw) if raw else None)
                except json.JSONDecodeError:
                    code, body = _status(400, "BadRequest", "the body is not JSON")
            data = json.dumps(body).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client gave up (a deadline): nothing to tell it

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return Handler
