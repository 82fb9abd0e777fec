"""The training notebooks run top to bottom in a reduced form: few examples and steps. Their
committed outputs are the full runs on SmolLM2-135M. The SFT notebook runs on that model here too
(training the real model end to end); GRPO and OPD, whose code paths SFT's model work shares, run
on the tiny model to keep the suite short."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def run_notebook(name: str, parameters: dict) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += "\n# reduced for the test\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def outputs(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def has_plot(nb) -> bool:
    return any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_sft_notebook_runs_and_learns(tiny_model):
    # on the tiny model, as the other notebooks' tests: the committed outputs show the default model learning
    nb = run_notebook("sft.ipynb", {"N_EPOCHS": 1, "MAX_TRAIN_EXAMPLES": 32, "EVAL_ITEMS": 8,
                                    "MODEL": str(tiny_model.source)})
    text = outputs(nb)
    assert "4 optimizer steps" in text
    assert "exact JSON answers: base" in text
    assert "exact_json: pass rate base" in text and "paired difference" in text
    assert has_plot(nb)  # the loss curve


def test_grpo_notebook_runs_and_plots_the_reward(tiny_model):
    nb = run_notebook("grpo.ipynb", {"STEPS": 2, "PROMPTS_PER_STEP": 2, "NUM_GENERATIONS": 4, "EVAL_ITEMS": 4,
                                     "MODEL": str(tiny_model.source)})
    text = outputs(nb)
    assert "2 steps in" in text and "held out, greedy: mean reward" in text
    assert "reward 1.0" in text and "reward 0.2" in text  # the grader's worked examples
    assert has_plot(nb)


def test_opd_notebook_runs_and_reports_the_gap(tiny_model):
    nb = run_notebook("opd.ipynb", {"TEACHER_EPOCHS": 1, "MAX_TRAIN_EXAMPLES": 16, "STEPS": 2, "PROMPTS_PER_STEP": 2,
                                    "NUM_GENERATIONS": 2, "EVAL_ITEMS": 4, "MODEL": str(tiny_model.source)})
    text = outputs(nb)
    assert "2 steps in" in text and "of the gap closed" in text
    assert has_plot(nb)


def test_agent_grpo_notebook_runs_and_plots_the_reward(tiny_model):
    nb = run_notebook("agent_grpo.ipynb", {"SFT_EXAMPLES": 8, "SFT_EPOCHS": 1, "STEPS": 2, "PROMPTS_PER_STEP": 2,
                                           "NUM_GENERATIONS": 2, "MAX_TOKENS": 48, "EVAL_ITEMS": 4,
                                           "MODEL": str(tiny_model.source)})
    text = outputs(nb)
    assert "2 steps in" in text and "held out, greedy: base" in text and "after SFT, held out as an agent" in text
    assert has_plot(nb)
