"""OpenAI's evals API (/v1/evals: evals, runs, output items) and Kiln's comparison of two runs.

The work happens in kiln.eval.service; these handlers run in worker threads (SQLite, file
reads), and a run samples and grades in a thread of its own, so none of it blocks the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import MediaType, Request, Response, delete, get, post

from kiln.errors import InvalidRequest
from kiln.eval.service import EvalService
from kiln.server.pagination import page, page_limit
from kiln.server.state import server_state


def _evals(request: Request) -> EvalService:
    return server_state(request).evals


def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _order(order: str | None) -> str:
    if order not in (None, "asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    return order or "asc"


# ---- evals ------------------------------------------------------------------------------------


@post("/v1/evals", status_code=200, sync_to_thread=True)
def create_eval(request: Request, data: dict[str, Any]) -> dict[str, Any]:
    return _evals(request).create_eval(data)


@get("/v1/evals", sync_to_thread=True)
def list_evals(request: Request, after: str | None = None, limit: int | None = None, order: str | None = None,
               order_by: str | None = None) -> dict[str, Any]:
    if order_by not in (None, "created_at", "updated_at"):
        raise InvalidRequest("order_by must be created_at or updated_at", param="order_by")
    return page(*_evals(request).list_evals(after, page_limit(limit), _order(order), order_by or "created_at"))


# A sync_to_thread GET on a path that also has POST and DELETE handlers answers with an unawaited
# coroutine (Litestar 2.25), so the two such GETs are async and move to a thread themselves.


@get("/v1/evals/{eval_id:str}")
async def retrieve_eval(request: Request, eval_id: str) -> dict[str, Any]:
    return await asyncio.to_thread(_evals(request).get_eval, eval_id)


@post("/v1/evals/{eval_id:str}", status_code=200, sync_to_thread=True)
def update_eval(request: Request, eval_id: str, data: dict[str, Any]) -> dict[str, Any]:
    return _evals(request).update_eval(eval_id, data)


@delete("/v1/evals/{eval_id:str}", status_code=200, sync_to_thread=True)
def delete_eval(request: Request, eval_id: str) -> dict[str, Any]:
    return _evals(request).delete_eval(eval_id)


@get("/v1/evals/{eval_id:str}/compare", sync_to_thread=True)
def compare_runs(request: Request, eval_id: str, runs: str, seed: int = 0) -> dict[str, Any]:
    """Kiln extension: `?runs=A,B` compares two runs of this eval on their shared items."""
    return _evals(request).compare(eval_id, [r.strip() for r in runs.split(",") if r.strip()], seed)


# ---- runs -------------------------------------------------------------------------------------


@post("/v1/evals/{eval_id:str}/runs", status_code=200, sync_to_thread=True)
def create_run(request: Request, eval_id: str, data: dict[str, Any]) -> dict[str, Any]:
    return _evals(request).create_run(eval_id, data, server_state(request).admit_inference, _base_url(request))


@get("/v1/evals/{eval_id:str}/runs", sync_to_thread=True)
def list_runs(request: Request, eval_id: str, after: str | None = None, limit: int | None = None,
              order: str | None = None, status: str | None = None) -> dict[str, Any]:
    runs = _evals(request).list_runs(eval_id, after, page_limit(limit), _order(order), status, _base_url(request))
    return page(*runs)


@get("/v1/evals/{eval_id:str}/runs/{run_id:str}")
async def retrieve_run(request: Request, eval_id: str, run_id: str) -> dict[str, Any]:
    return await asyncio.to_thread(_evals(request).get_run, eval_id, run_id, _base_url(request))


@post("/v1/evals/{eval_id:str}/runs/{run_id:str}", status_code=200, sync_to_thread=True)
def cancel_run(request: Request, eval_id: str, run_id: str) -> dict[str, Any]:
    return _evals(request).cancel_run(eval_id, run_id, _base_url(request))


@delete("/v1/evals/{eval_id:str}/runs/{run_id:str}", status_code=200, sync_to_thread=True)
def delete_run(request: Request, eval_id: str, run_id: str) -> dict[str, Any]:
    return _evals(request).delete_run(eval_id, run_id)


@get("/v1/evals/{eval_id:str}/runs/{run_id:str}/output_items", sync_to_thread=True)
def list_output_items(request: Request, eval_id: str, run_id: str, after: str | None = None,
                      limit: int | None = None, order: str | None = None, status: str | None = None) -> dict[str, Any]:
    return page(*_evals(request).output_items(eval_id, run_id, after, page_limit(limit), _order(order), status))


@get("/v1/evals/{eval_id:str}/runs/{run_id:str}/output_items/{output_item_id:str}", sync_to_thread=True)
def retrieve_output_item(request: Request, eval_id: str, run_id: str, output_item_id: str) -> dict[str, Any]:
    return _evals(request).output_item(eval_id, run_id, output_item_id)


@get("/v1/evals/{eval_id:str}/runs/{run_id:str}/report", sync_to_thread=True)
def run_report(request: Request, eval_id: str, run_id: str) -> Response[str]:
    """The run's `report_url`: pass rates, score distributions and every item, as one HTML page."""
    return Response(_evals(request).report(eval_id, run_id), media_type=MediaType.HTML)


ROUTES = [create_eval, list_evals, retrieve_eval, update_eval, delete_eval, compare_runs, create_run, list_runs,
          retrieve_run, cancel_run, delete_run, list_output_items, retrieve_output_item, run_report]
