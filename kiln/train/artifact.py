"""The manifest of a trained adapter, whatever trained it (SFT, GRPO, distillation)."""

from __future__ import annotations

import datetime


def default_adapter_name(trainer: str) -> str:
    """The name a run's adapter gets when none is given: the trainer and the local time."""
    return f"{trainer}-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def adapter_manifest(name: str, model, *, method: str, source: str, config: dict, rank: int, alpha: float, modules,
                     inputs: list[dict], training: dict, steps: int, trained_tokens: int, final_metrics: dict):
    """method: OpenAI's method type ("supervised", "reinforcement", ...); source: the trainer
    ("sft", "grpo", ...). Binds the base model (id, weights digest), the LoRA shape, the training inputs (purpose,
    sha256, file id for jobs), the resolved config, and provenance (times, job, steps, tokens,
    the last step's metrics)."""
    from kiln.adapters.manifest import BaseModelRef, Manifest, provenance
    from kiln.models.lora import module_shapes

    shapes = module_shapes(model.config)  # a mixture of experts' adapters have no MLP modules
    return Manifest(
        name=name, base_model=BaseModelRef(model.model_id, model.weights_digest, model.config.architecture),
        rank=rank, alpha=alpha, target_modules=[m for m in modules if m in shapes], weights_digest="",
        provenance=provenance(f"training:{source}"),
        training_inputs_digest=inputs[0]["sha256"] if inputs else "", training_inputs=inputs,
        config={"method": method, **config},
        training={**training, "steps": steps, "trained_tokens": trained_tokens, "final_metrics": final_metrics})
