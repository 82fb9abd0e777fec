"""The console: a page the server itself serves (`GET /console`) showing serving, training jobs,
evals and adapters live, and the data routes it polls (`/console/api/...`).

With `api_keys` set, the page and its data need a key like the API does. A browser cannot send a
bearer header when it opens a page, so `/console?key=<key>` trades the key for a cookie (HttpOnly,
SameSite=Strict, path /console; it holds an HMAC of the key under a per-process secret, never the
key) and redirects to the same address without it. The data routes take the cookie or a bearer key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from litestar import Request, Response, get
from litestar.datastructures import Cookie
from litestar.enums import MediaType

from kiln.server.admin_routes import serving_status
from kiln.server.state import server_settings, server_state

PAGE = (resources.files("kiln.server") / "static" / "console.html").read_text()  # shipped as package data
UNAUTHORIZED_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Kiln console</title>
<style>body { font: 15px/1.5 system-ui, sans-serif; margin: 48px; color: #1d2430; }
code { background: #eef1f5; padding: 2px 5px; }</style></head>
<body><h1>Kiln console</h1><p>@WHY@ Open <code>/console?key=&lt;your API key&gt;</code>: the key is
exchanged for a cookie that lasts as long as this server process, and removed from the address.</p>
</body></html>"""
PATH = "/console"
COOKIE = "kiln_console"
_SECRET = secrets.token_bytes(32)  # cookies end with the process: a restart asks for the key again
SERIES_LIMIT = 100_000  # a job's metrics events read for its curves (one per optimizer step)
LATENCY_WINDOW_S = 60.0


def _cookie_value(key: str) -> str:
    return hmac.new(_SECRET, key.encode(), hashlib.sha256).hexdigest()


def _accepted(key: str, keys: list[str]) -> bool:
    return any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)


def is_console_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def authorized(request: Request, keys: list[str]) -> bool:
    """A console request carries a key: a bearer header, or the cookie the page's `?key=` set."""
    header = request.headers.get("authorization", "")
    if header.startswith("Bearer ") and _accepted(header[7:].strip(), keys):
        return True
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and any(hmac.compare_digest(cookie, _cookie_value(k)) for k in keys)


@get(PATH, sync_to_thread=False, include_in_schema=False)
def console_page(request: Request, key: str | None = None) -> Response:
    keys = server_settings(request).server.api_keys
    if keys and key is not None:
        if not _accepted(key, keys):
            return Response(UNAUTHORIZED_PAGE.replace("@WHY@", "That key is not accepted."), status_code=401,
                            media_type=MediaType.HTML)
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "key"])
        cookie = Cookie(key=COOKIE, value=_cookie_value(key), path=PATH, httponly=True, samesite="strict")
        return Response(b"", status_code=303, headers={"Location": PATH + (f"?{rest}" if rest else "")},
                        cookies=[cookie])
    if keys and not authorized(request, keys):
        return Response(UNAUTHORIZED_PAGE.replace("@WHY@", "This server needs an API key."), status_code=401,
                        media_type=MediaType.HTML)
    return Response(PAGE, media_type=MediaType.HTML, headers={"Cache-Control": "no-store"})


# ---- data routes ---------------------------------------------------------------------------------

def _owner(snapshot: dict, ownership: dict) -> str:
    """Who holds the accelerator now, in a few words."""
    if ownership["active_writer"]:
        return ownership["active_writer"]
    if snapshot["running"]:
        return "serving"
    return "idle"


@get(f"{PATH}/api/overview", sync_to_thread=False, include_in_schema=False)
def overview(request: Request) -> dict[str, Any]:
    """Serving now: counters (the page turns them into rates), gauges, latency percentiles over the
    last minute, who owns the accelerator, and the jobs' queue."""
    st = server_state(request)
    s = st.engine.snapshot
    ownership = st.engine.ownership.snapshot()
    policy = st.profile.policy
    inference = {"on": policy.inference_admission and not st.draining,
                 "reason": None if policy.inference_admission else
                 f"inference is off: the {st.profile.profile.value} serving profile admits no inference requests"}
    if st.draining:
        inference["reason"] = "inference is off: the server is shutting down"
    jobs = st.jobs.snapshot()
    return {
        "object": "console.overview", "time": time.time(), "model": st.model_id, "status": serving_status(st),
        "serving_profile": st.profile.profile.value, "inference": inference, "backend_route": st.backend_route,
        "counters": {k: s[k] for k in ("prompt_tokens", "generation_tokens", "finished", "prefix_queries",
                                       "prefix_hits", "preemptions", "steps", "compile_waits")},
        "requests": {"running": s["running"], "waiting": s["waiting"]},
        "kv_cache": {"usage": s["kv_usage"], "blocks": s["kv_blocks_total"],
                     "used_blocks": s["kv_blocks_total"] - s["kv_blocks_free"]},
        "latency": st.metrics.recent_latencies(LATENCY_WINDOW_S),
        "accelerator": {"owner": _owner(s, ownership), **ownership},
        "adapters": {"slots_used": s["lora_slots_used"], "slots": s["lora_slots_total"]},
        "jobs": {"running": jobs["running"], "queued": jobs["queued"]},
    }


def _job_row(job: dict) -> dict[str, Any]:
    kiln = job.get("kiln") or {}
    gate = kiln.get("gate_result")
    return {"id": job["id"], "status": job["status"], "model": job["model"], "method": job["method"]["type"],
            "adapter": kiln.get("adapter_name"), "fine_tuned_model": job["fine_tuned_model"],
            "created_at": job["created_at"], "finished_at": job["finished_at"], "step": kiln.get("step"),
            "total_steps": kiln.get("total_steps"), "trained_tokens": job["trained_tokens"],
            "gate": None if gate is None else {"passed": gate["passed"]}, "error": job["error"]}


@get(f"{PATH}/api/jobs", sync_to_thread=True, include_in_schema=False)
def jobs(request: Request) -> dict[str, Any]:
    st = server_state(request)
    return {"object": "list", "data": [_job_row(j) for j in st.jobs.store.list_jobs()]}


@get(f"{PATH}/api/jobs/{{job_id:str}}", sync_to_thread=True, include_in_schema=False)
def job(request: Request, job_id: str) -> dict[str, Any]:
    """A job's curves (every metrics event, by step), checkpoints, gate and latest messages."""
    manager = server_state(request).jobs
    found = manager.get(job_id)  # 404 job_not_found, as the jobs API answers
    events, _ = manager.store.events(job_id, None, SERIES_LIMIT)
    events.reverse()  # oldest first
    series = [e["data"] for e in events if e["type"] == "metrics" and e.get("data")]
    checkpoints, _ = manager.store.checkpoints(job_id, None, SERIES_LIMIT)
    messages = [{"created_at": e["created_at"], "level": e["level"], "message": e["message"]}
                for e in events if e["type"] != "metrics"][-30:]
    kiln = found.get("kiln") or {}
    return {"object": "console.job", **_job_row(found), "hyperparameters": found["hyperparameters"],
            "training_file": found["training_file"], "validation_file": found["validation_file"],
            "series": series, "checkpoints": checkpoints, "gate": kiln.get("gate"),
            "gate_result": kiln.get("gate_result"), "messages": messages}


def _pass_rates(run: dict) -> list[dict[str, Any]]:
    out = []
    for c in run.get("per_testing_criteria_results") or []:
        graded = c["passed"] + c["failed"]
        out.append({"criterion": c["testing_criteria"], "passed": c["passed"], "failed": c["failed"],
                    "pass_rate": c["passed"] / graded if graded else None})
    return out


@get(f"{PATH}/api/evals", sync_to_thread=True, include_in_schema=False)
def evals(request: Request) -> dict[str, Any]:
    """Evals, newest first, each with its runs' pass rates per criterion."""
    service = server_state(request).evals
    out = []
    for ev in service.list_evals(None, 200, "desc", "created_at")[0]:
        runs, _ = service.store.list_runs(ev["id"], None, 200, "desc", None)
        out.append({"id": ev["id"], "name": ev["name"], "created_at": ev["created_at"],
                    "criteria": [c["name"] for c in ev["testing_criteria"]],
                    "runs": [{"id": r["id"], "name": r["name"], "model": r["model"], "status": r["status"],
                              "created_at": r["created_at"], "result_counts": r["result_counts"],
                              "pass_rates": _pass_rates(r), "report": f"{PATH}/evals/{ev['id']}/runs/{r['id']}/report"}
                             for r in runs]})
    return {"object": "list", "data": out}


@get(f"{PATH}/api/evals/{{eval_id:str}}/compare", sync_to_thread=True, include_in_schema=False)
def compare(request: Request, eval_id: str, runs: str, seed: int = 0) -> dict[str, Any]:
    """Two runs of one eval side by side: per criterion, the difference with its interval and the
    flipped items (the evals API's own comparison, `?runs=A,B`)."""
    return server_state(request).evals.compare(eval_id, [r.strip() for r in runs.split(",") if r.strip()], seed)


@get(f"{PATH}/evals/{{eval_id:str}}/runs/{{run_id:str}}/report", sync_to_thread=True, include_in_schema=False)
def report(request: Request, eval_id: str, run_id: str) -> Response:
    """A run's report page under the console's path, so the console's cookie opens it."""
    return Response(server_state(request).evals.report(eval_id, run_id), media_type=MediaType.HTML)


@get(f"{PATH}/api/adapters", sync_to_thread=True, include_in_schema=False)
def adapters(request: Request) -> dict[str, Any]:
    """Adapters: loaded ones with their slot and since when, stored ones, each with its lineage
    (base model, training inputs, the job that made it, its eval results)."""
    st = server_state(request)
    made_by = {j["fine_tuned_model"]: j["id"] for j in reversed(st.jobs.store.list_jobs()) if j["fine_tuned_model"]}
    out = []
    for a in st.adapters.describe_all():
        artifact = st.adapters.get(a["name"])
        artifact = artifact.artifact if artifact is not None else st.adapters.stored(a["name"])
        manifest = artifact.manifest if artifact is not None else None
        out.append({**a, "state": "live" if a["loaded"] else "stored", "job": made_by.get(a["name"]),
                    "source_kind": manifest.provenance.source if manifest else None,
                    "parent": manifest.provenance.parent_adapter.name
                    if manifest and manifest.provenance.parent_adapter else None,
                    "training_inputs": manifest.training_inputs if manifest else None})
    return {"object": "list", "data": out, "max_loras": st.engine.config.max_loras}


ROUTES = [console_page, overview, jobs, job, evals, compare, report, adapters]
