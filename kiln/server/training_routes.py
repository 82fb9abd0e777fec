"""OpenAI's files and fine-tuning jobs API, and the runtime state (`/v1/runtime`)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.enums import RequestEncodingType
from litestar.params import Body

from kiln.errors import DataError, InvalidRequest, NotFound
from kiln.server.pagination import page, page_limit
from kiln.server.state import ServerState, server_state
from kiln.train import memory
from kiln.train.data import is_prompt_file, load_examples, load_prompts, read_jsonl
from kiln.train.jobs import ACTIVE
from kiln.train.sft import file_digest
from kiln.train.store import TrainingStore

PURPOSES = ("fine-tune", "evals", "batch", "user_data", "assistants", "vision")


def _jobs(request: Request):
    st: ServerState = server_state(request)
    return st.jobs


def _store(request: Request) -> TrainingStore:
    return _jobs(request).store


def _file(request: Request, file_id: str) -> dict:
    file = _store(request).get_file(file_id)
    if file is None:
        raise NotFound(f"No such File object: {file_id}", code="file_not_found", param="file_id")
    return file


@post("/v1/files", status_code=200, sync_to_thread=True)
def upload_file(request: Request,
                data: Annotated[dict[str, Any], Body(media_type=RequestEncodingType.MULTI_PART)]) -> dict[str, Any]:
    purpose, upload = data.get("purpose"), data.get("file")
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("a multipart 'file' part is required", param="file")
    content = upload.file.read()
    if purpose == "fine-tune":  # refuse a file no job could train on, naming the line at fault
        tokenizer, what = server_state(request).tokenizer, f"file {upload.filename}"
        try:
            if is_prompt_file(read_jsonl(content, what)):  # prompts for reinforcement fine-tuning
                load_prompts(content, tokenizer, 1 << 20, what)
            else:
                load_examples(content, tokenizer, 1 << 20, what)
        except DataError as exc:
            if exc.code == DataError.default_code:
                exc.code = "invalid_file"
            raise exc.with_param("file") from None
    return _store(request).add_file(content, upload.filename or "upload.jsonl", purpose, file_digest(content))


@get("/v1/files", sync_to_thread=True)
def list_files(request: Request, purpose: str | None = None) -> dict[str, Any]:
    return page(_store(request).list_files(purpose), False)


@get("/v1/files/{file_id:str}", sync_to_thread=True)
def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return _file(request, file_id)


@get("/v1/files/{file_id:str}/content", sync_to_thread=True, media_type="application/octet-stream")
def file_content(request: Request, file_id: str) -> Response:
    _file(request, file_id)
    return Response(_store(request).file_content(file_id), media_type="application/octet-stream")


@delete("/v1/files/{file_id:str}", status_code=200, sync_to_thread=True)
def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    _file(request, file_id)
    active = [j["id"] for j in _store(request).list_jobs((*ACTIVE, "paused"))
              if file_id in (j["training_file"], j["validation_file"])]
    if active:
        raise InvalidRequest(f"file {file_id} is used by fine-tuning job {active[0]}", code="file_in_use",
                             param="file_id")
    _store(request).delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@post("/v1/fine_tuning/jobs", status_code=200, sync_to_thread=True)
def create_job(request: Request, data: dict[str, Any]) -> dict[str, Any]:
    return _jobs(request).create(data)


@get("/v1/fine_tuning/jobs", sync_to_thread=True)
def list_jobs(request: Request, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
    return page(*_jobs(request).list(after, page_limit(limit, 20)))


@get("/v1/fine_tuning/jobs/{job_id:str}", sync_to_thread=True)
def retrieve_job(request: Request, job_id: str) -> dict[str, Any]:
    return _jobs(request).get(job_id)


@post("/v1/fine_tuning/jobs/{job_id:str}/cancel", status_code=200, sync_to_thread=True)
def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
    return _jobs(request).cancel(job_id)


@post("/v1/fine_tuning/jobs/{job_id:str}/rollouts", status_code=200, sync_to_thread=True)
def submit_rollouts(request: Request, job_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """Kiln extension: scored rollouts for a reinforcement job created with kiln.rollouts =
    "external"; answers once the job has trained on them."""
    return _jobs(request).submit_rollouts(job_id, data)


@post("/v1/fine_tuning/jobs/{job_id:str}/pause", status_code=200, sync_to_thread=True)
def pause_job(request: Request, job_id: str) -> dict[str, Any]:
    return _jobs(request).pause(job_id)


@post("/v1/fine_tuning/jobs/{job_id:str}/resume", status_code=200, sync_to_thread=True)
def resume_job(request: Request, job_id: str) -> dict[str, Any]:
    return _jobs(request).resume(job_id)


@get("/v1/fine_tuning/jobs/{job_id:str}/events", sync_to_thread=True)
def job_events(request: Request, job_id: str, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
    _jobs(request).get(job_id)
    return page(*_store(request).events(job_id, after, page_limit(limit, 20)))


@get("/v1/fine_tuning/jobs/{job_id:str}/checkpoints", sync_to_thread=True)
def job_checkpoints(request: Request, job_id: str, after: str | None = None,
                    limit: int | None = None) -> dict[str, Any]:
    _jobs(request).get(job_id)
    return page(*_store(request).checkpoints(job_id, after, page_limit(limit, 10)))


@get("/v1/runtime", sync_to_thread=True)
def runtime(request: Request) -> dict[str, Any]:
    """The effective runtime state: the memory budget and what holds it, jobs, ownership."""
    st = server_state(request)
    jobs = st.jobs.snapshot()
    free, source = memory.available_bytes(st.settings.train.memory_budget_bytes)
    share = st.jobs.share
    held = {**{f"{k}_bytes": v for k, v in share.serving_bytes.items()}, "training_bytes": jobs["training_bytes"]}
    kv = {"blocks": st.engine.snapshot["kv_blocks_total"] + 1, "configured_blocks": share.kv_blocks,
          "block_bytes": share.kv_block_bytes}
    return {"object": "runtime", "serving_profile": st.profile.profile.value,
            "memory": {**held, "available_bytes": free, "budget_source": source, "kv_pool": kv},
            "jobs": {"running": jobs["running"], "queued": jobs["queued"]},
            "ownership": st.engine.ownership.snapshot()}


ROUTES = [upload_file, list_files, retrieve_file, file_content, delete_file, create_job, list_jobs, retrieve_job,
          cancel_job, pause_job, resume_job, job_events, job_checkpoints, submit_rollouts, runtime]
