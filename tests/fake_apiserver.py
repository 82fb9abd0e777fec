"""A small in-process stand-in for the Kubernetes API server, for the router's tests.

It is a real HTTP server (a ThreadingHTTPServer on loopback) speaking just enough of the REST API:

- an in-memory object store keyed by (api path, namespace, plural, name), e.g.
  ("apis/coordination.k8s.io/v1", "kiln", "leases", "kiln-router"), with one resourceVersion
  counter: GET (one or a list), POST (409 AlreadyExists), PUT (409 Conflict when
  metadata.resourceVersion is stale, 404 when absent) and DELETE. Any namespaced or cluster-scoped
  plural works, so later tests can store EndpointSlices, Pods or custom resources the same way.
  A list takes `labelSelector` (equality terms only: `a=b,c!=d`) and `?watch=true` streams
  ADDED/MODIFIED/DELETED events as JSON lines after `resourceVersion` (until `timeoutSeconds`,
  the client leaving, the server stopping, or `end_watches()`). After `compact()`, a watch from an
  older resourceVersion gets an ERROR event with 410 Expired, as from a real apiserver.
- The status subresource (`.../{plural}/{name}/status`): GET, PUT and PATCH (JSON merge patch)
  change only the object's `status`, and are counted in `status_writes` as (plural, name).
- TokenReviews (POST /apis/authentication.k8s.io/v1/tokenreviews), answered from `tokens`, which
  the test fills, counted in `token_reviews`, slowed by `token_review_delay_s`.

Every request must carry the bearer token of the kubeconfig that `write_kubeconfig` writes;
`unavailable = True` answers 503 to everything (an apiserver that is down but listening);
a plural in `forbidden` answers 403 (RBAC that does not allow it).
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
from urllib.parse import parse_qs, urlsplit

BEARER = "fake-apiserver-token"
TOKEN_REVIEWS = "apis/authentication.k8s.io/v1"

# /api/v1/... or /apis/{group}/{version}/..., then namespaces/{ns}/ or not, then {plural}[/{name}]
_PATH = re.compile(
    r"^/(?P<api>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?"
    r"(?P<status>/status)?/?$"
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
        self.forbidden: set[str] = set()  # plurals answered 403
        self.status_writes: list[tuple[str, str]] = []  # (plural, name) of each status PUT or PATCH
        self.compacted = 0  # watches from before this resourceVersion get 410 Expired
        self.watch_epoch = 0  # end_watches() bumps it: open watches end
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        # every change, for watches: (resourceVersion, event type, key, object)
        self.events: list[tuple[int, str, tuple[str, str, str, str], dict[str, Any]]] = []
        self.changed = threading.Condition(self.lock)
        self.stopping = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.stopping = True
            self.changed.notify_all()
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

    def delete(self, api: str, namespace: str, plural: str, name: str) -> None:
        with self.lock:
            self._remove((api, namespace, plural, name))

    def compact(self) -> None:
        """Forget the event history: a watch resuming from before now gets 410 Expired."""
        with self.lock:
            self.compacted = self.resource_version
            self.changed.notify_all()

    def end_watches(self) -> None:
        """End every open watch stream (as an apiserver restart would)."""
        with self.lock:
            self.watch_epoch += 1
            self.changed.notify_all()

    def _store(self, api: str, namespace: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.resource_version += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.resource_version)
        if namespace:
            meta["namespace"] = namespace
        key = (api, namespace, plural, meta["name"])
        self._event("MODIFIED" if key in self.objects else "ADDED", key, obj)
        self.objects[key] = obj
        return json.loads(json.dumps(obj))

    def _remove(self, key: tuple[str, str, str, str]) -> dict[str, Any] | None:
        obj = self.objects.pop(key, None)
        if obj is not None:
            self.resource_version += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.resource_version)}}
            self._event("DELETED", key, obj)
        return obj

    def _event(self, kind: str, key: tuple[str, str, str, str], obj: dict[str, Any]) -> None:
        self.events.append((self.resource_version, kind, key, json.loads(json.dumps(obj))))
        self.changed.notify_all()

    def _selected(self, api: str, ns: str, plural: str, query: dict[str, list[str]]):
        """The predicate of a list or watch: same resource, namespace (unless none) and labels."""
        terms = [t for t in (query.get("labelSelector", [""])[0]).split(",") if t]

        def selected(key: tuple[str, str, str, str], obj: dict[str, Any]) -> bool:
            if key[0] != api or key[2] != plural or (ns and key[1] != ns):
                return False
            labels = obj.get("metadata", {}).get("labels") or {}
            for term in terms:
                name, op, value = re.match(r"^([^!=]+)(!=|==|=)?(.*)$", term).groups()
                if op is None and name not in labels:
                    return False
                if op in ("=", "==") and labels.get(name) != value or op == "!=" and labels.get(name) == value:
                    return False
            return True

        return selected

    def watch(self, api: str, ns: str, plural: str, query: dict[str, list[str]], send) -> None:
        """Calls send(event) for each change after the query's resourceVersion, until timeoutSeconds,
        the server stopping, or send raising (the client went away)."""
        selected = self._selected(api, ns, plural, query)
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["3600"])[0])
        with self.lock:
            epoch = self.watch_epoch
            expired = since and since < self.compacted
        if expired:
            send({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")[1]})
            return
        while True:
            with self.lock:
                if self.watch_epoch != epoch:
                    return
                if not since:  # no version given: the current objects first, as ADDED
                    since = self.resource_version
                    pending = [("ADDED", o) for k, o in sorted(self.objects.items()) if selected(k, o)]
                else:
                    pending = [(t, o) for rv, t, k, o in self.events if rv > since and selected(k, o)]
                    since = self.resource_version
                if not pending:
                    left = deadline - time.monotonic()
                    if self.stopping or left <= 0:
                        return
                    self.changed.wait(min(left, 0.5))
                    continue
            for kind, obj in pending:
                send({"type": kind, "object": obj})

    def handle(
        self, method: str, path: str, body: dict[str, Any] | None, query: dict[str, list[str]] | None = None
    ) -> tuple[int, dict[str, Any]]:
        query = query or {}
        self.requests.append((method, path))
        if self.unavailable:
            return _status(503, "ServiceUnavailable", "the fake apiserver is unavailable")
        m = _PATH.match(path)
        if m is None:
            return _status(404, "NotFound", f"no route for {path}")
        api, ns, plural, name = m["api"], m["ns"] or "", m["plural"], m["name"]
        if plural in self.forbidden:
            return _status(403, "Forbidden", f'{plural} is forbidden: User "fake" cannot {method.lower()} {plural}')
        if (api, plural) == (TOKEN_REVIEWS, "tokenreviews") and method == "POST":
            return 201, self._review(body or {})
        with self.lock:
            key = (api, ns, plural, name or "")
            current = self.objects.get(key)
            if m["status"] and name is not None:
                return self._status_subresource(method, key, current, body)
            if method == "GET" and name is None:
                selected = self._selected(api, ns, plural, query)
                items = [o for k, o in sorted(self.objects.items()) if selected(k, o)]
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
                if self._remove(key) is None:
                    return _not_found(plural, name)
                return _status(200, "", "deleted", status="Success")
        return _status(405, "MethodNotAllowed", f"{method} {path} is not supported by the fake")

    def _status_subresource(
        self, method: str, key: tuple[str, str, str, str], current: dict[str, Any] | None, body: dict[str, Any] | None
    ) -> tuple[int, dict[str, Any]]:
        plural, name = key[2], key[3]
        if current is None:
            return _not_found(plural, name)
        if method == "GET":
            return 200, current
        if method not in ("PUT", "PATCH") or body is None:
            return _status(405, "MethodNotAllowed", f"{method} of {plural}/status is not supported by the fake")
        self.status_writes.append((plural, name))
        updated = json.loads(json.dumps(current))
        if method == "PUT":
            sent = body.get("metadata", {}).get("resourceVersion")
            if sent and sent != current["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}"')
            updated["status"] = body.get("status")
        else:
            updated["status"] = _merge(current.get("status"), body.get("status"))
        return 200, self._store(key[0], key[1], plural, updated)

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


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = _merge(merged.get(k), v)
    return merged


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
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if self.headers.get("Authorization") != f"Bearer {BEARER}":
                code, body = _status(401, "Unauthorized", "Unauthorized")
            elif self.command == "GET" and query.get("watch", [""])[0] in ("true", "1") and not api.unavailable:
                return self._watch(url.path, query)
            else:
                try:
                    code, body = api.handle(self.command, url.path, json.loads(raw) if raw else None, query)
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

        def _watch(self, path: str, query: dict[str, list[str]]) -> None:
            m = _PATH.match(path)
            if m is None or m["name"] is not None or m["plural"] in api.forbidden:
                code, body = (
                    _status(404, "NotFound", f"no watch route for {path}")
                    if m is None or m["name"] is not None
                    else api.handle("GET", path, None)
                )
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(event: dict[str, Any]) -> None:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()

            try:
                api.watch(m["api"], m["ns"] or "", m["plural"], query, send)
                self.wfile.write(b"0\r\n\r\n")  # the end of the stream: the client watches again
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    return Handler
