"""The judge of model graders when Kiln itself serves the judge model: one chat completion on
the engine in this process (the base model, or an adapter by name)."""

from __future__ import annotations

from collections.abc import Callable

from kiln.engine.params import SamplingParams
from kiln.errors import NotFound
from kiln.graders.model import JudgeReply

JUDGE_MAX_TOKENS = 256  # when the grader's sampling_params set no max_completions_tokens
JUDGE_TIMEOUT_S = 300.0


def engine_judge(engine, select_adapter: Callable[[str], object | None]):
    """A `Judge` over `engine`. select_adapter(model) gives the AdapterWeights a model name
    selects (None: the base model) or raises NotFound."""
    tokenizer = engine.model.tokenizer

    def judge(model: str, messages: list[dict], params: dict) -> JudgeReply:
        adapter = select_adapter(model)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = params.get("max_completions_tokens") or max(1, min(JUDGE_MAX_TOKENS,
                                                                        engine.max_model_len - len(prompt)))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=params.get("temperature", 0.0) or 0.0,
                                  top_p=params.get("top_p") or 1.0, seed=params.get("seed"))
        [[completion]] = engine.complete([prompt], sampling, adapter=adapter, timeout=JUDGE_TIMEOUT_S)
        return JudgeReply(completion.text, len(prompt), len(completion.token_ids))

    return judge


def base_model_judge(engine):
    """A judge over `engine`'s base model only (in-process runs have no adapter registry)."""

    def base_only(model: str):
        if model in (None, "", engine.model.model_id):
            return None
        raise NotFound(f"only the base model {engine.model.model_id!r} judges in this process; pass judge= to "
                       f"use {model!r}", code="model_not_found", param="model")

    return engine_judge(engine, base_only)
