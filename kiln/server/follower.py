"""A server process other than 0 (`[distributed] num_processes` > 1): it follows process 0's steps
(kiln.engine.step_mirror) and answers only `/health` on the server port, so that every pod of a
multi-host server takes the same probes: 503 `starting` until it follows, then 200 `following`.
Requests go to process 0."""

from __future__ import annotations

import http.server
import json
import socket
import threading

from kiln.config import Settings


def serve_follower(settings: Settings, index: int, sock: socket.socket) -> int:
    from kiln.engine.setup import follow  # lazy: pulls in JAX

    following = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            status, body = (200, "following") if following.is_set() else (503, "starting")
            if self.path.split("?")[0] != "/health":
                status, body = 404, "process 0 serves requests"
            payload = json.dumps({"status": body, "process": index}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:  # probes are not worth a log line each
            pass

    server = http.server.ThreadingHTTPServer(sock.getsockname()[:2], Health, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    threading.Thread(target=server.serve_forever, name="kiln-follower-health", daemon=True).start()
    try:
        return follow(settings, index, following)
    finally:
        server.shutdown()
        sock.close()
