"""OpenAI's grader API, run locally: POST /v1/fine_tuning/alpha/graders/run and /validate.

Model graders are judged by a model this server serves (the base model or a loaded
adapter, by name): the messages are rendered with the served model's chat template and
generated on the engine, like a chat completion.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post

from kiln import graders
from kiln.errors import InvalidRequest, NotFound
from kiln.graders.engine_judge import engine_judge
from kiln.server.state import ServerState, server_state


def _grader(data: dict[str, Any]) -> graders.Grader:
    if "grader" not in data:
        raise InvalidRequest("grader is required", param="grader")
    return graders.validate(data["grader"])


def make_judge(st: ServerState) -> graders.Judge:
    """The judge of model graders: one chat completion on this server's engine."""

    def adapter_weights(model: str):
        adapter = st.select_model(model)
        return adapter.weights if adapter is not None else None

    return engine_judge(st.engine, adapter_weights)


@post("/v1/fine_tuning/alpha/graders/run", status_code=200, sync_to_thread=True)
def run_grader(request: Request, data: dict[str, Any]) -> dict[str, Any]:
    grader = _grader(data)
    sample = data.get("model_sample")
    if sample is None:
        raise InvalidRequest("model_sample is required", param="model_sample")
    if not isinstance(sample, str):
        raise InvalidRequest("model_sample must be a string", param="model_sample")
    item = data.get("item")
    if item is not None and not isinstance(item, dict | list):
        raise InvalidRequest("item must be an object", param="item")
    st = server_state(request)
    judges = _judges(grader)
    if judges:  # refuse before grading: a judge that cannot run is the request's fault, not the sample's
        st.admit_inference()
        for param, model in judges:
            try:
                st.select_model(model)
            except NotFound as exc:
                raise exc.with_param(param) from None
    result = grader.grade(graders.make_sample(sample), item, judge=make_judge(st) if judges else None)
    return result.to_openai()


def _judges(grader: graders.Grader, param: str = "grader") -> list[tuple[str, str]]:
    """(param, model) of every model grader in the grader, a multi grader's parts included."""
    if isinstance(grader, graders.MultiGrader):
        return [j for key, part in grader.graders.items() for j in _judges(part, f"{param}.graders.{key}")]
    return [(f"{param}.model", model) for model in grader.judge_models()]


@post("/v1/fine_tuning/alpha/graders/validate", status_code=200, sync_to_thread=False)
def validate_grader(data: dict[str, Any]) -> dict[str, Any]:
    return {"grader": _grader(data).to_json()}


ROUTES = [run_grader, validate_grader]
