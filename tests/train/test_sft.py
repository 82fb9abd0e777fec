"""SFT: training data (chat template rendering, assistant-only masks, line-numbered errors),
length buckets, and a run that teaches the tiny model a reply which the engine then serves
from the saved artifact."""

import json

import jax
import numpy as np
import pytest

from kiln.adapters.registry import AdapterRegistry
from kiln.adapters.store import AdapterStore, load_weights
from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.params import SamplingParams
from kiln.errors import DataError
from kiln.models.loader import load_model
from kiln.train.data import epoch_batches, length_buckets, load_examples
from kiln.train.sft import SFTConfig, SFTRun, sft

REPLY = "kiln says hi"


def jsonl(records) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


def trained_text(tokenizer, example) -> str:
    ids = [int(i) for i, t in zip(example.ids, example.trained, strict=True) if t]
    return tokenizer.decode(ids)


def test_only_assistant_tokens_are_trained(tiny_model):
    tok = tiny_model.tokenizer
    data = jsonl([
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "first", "weight": 0}, {"role": "user", "content": "again"},
                      {"role": "assistant", "content": "second"}]},
        {"prompt": "2+2=", "completion": "4"},
    ])
    chat, plain = load_examples(data, tok, 512)
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "first"}, {"role": "user", "content": "again"},
         {"role": "assistant", "content": "second"}], add_generation_prompt=False)
    assert tok.decode(chat.ids.tolist()) == rendered  # the whole conversation, tokenized at once
    assert trained_text(tok, chat) == "second<|im_end|>\n"  # weight 0 leaves "first" out
    assert trained_text(tok, plain) == "4<|im_end|>"  # the completion and the end-of-sequence token
    assert plain.trained[0] == 0


@pytest.mark.parametrize("text, message", [
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n{oops\n',
     "line 2: not valid JSON"),
    ('[1, 2]\n', "line 1: expected a JSON object"),
    ('{"messages": [{"role": "wizard", "content": "a"}]}\n', "line 1, messages[0]: role must be one of"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}\n', "line 1: no assistant message"),
    ('{"messages": [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}]}\n',
     "line 1, messages[0]: 'weight' is 0 or 1, on assistant messages only"),
    ('{"text": "free text"}\n', 'line 1: expected {"messages"'),
    ('{"prompt": "a", "completion": 3}\n', "line 1: 'prompt' and 'completion' must be strings"),
    ('\n\n', "has no examples"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}\n',
     "no trainable tokens"),
])
def test_bad_training_files_are_refused_with_the_line(tiny_model, text, message):
    with pytest.raises(DataError) as err:
        load_examples(text, tiny_model.tokenizer, 512)
    assert message in err.value.message
    assert err.value.status == 400


def test_batches_use_a_few_length_buckets(tiny_model):
    assert length_buckets(1024) == [32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768,
                                    896, 1024]
    assert length_buckets(100) == [32, 48, 64, 80, 96, 100]
    rng = np.random.RandomState(0)
    records = [{"prompt": "x" * int(rng.randint(1, 200)), "completion": "y" * int(rng.randint(1, 100))}
               for _ in range(50)]
    examples = load_examples(jsonl(records), tiny_model.tokenizer, 256)
    batches = list(epoch_batches(examples, 4, length_buckets(256), seed=1))
    assert {b.tokens.shape for b in batches} <= {(4, n) for n in length_buckets(256)}
    assert sum(int(b.valid[:, 0].sum()) for b in batches) == 50  # every example once
    assert sum(float(b.loss_mask.sum()) for b in batches) == sum(e.trained_tokens for e in examples)
    for b in batches:  # each trained position predicts the next token of its row
        n, S = int(b.loss_mask.sum()), b.tokens.shape[1]
        assert b.loss_mask.shape[0] in length_buckets(4 * S) and len(set(b.loss_index[:n])) == n
        rows, cols = np.divmod(b.loss_index[:n], S)
        assert b.valid[rows, cols].all()
        inner = (cols + 1 < S) & b.valid[rows, np.minimum(cols + 1, S - 1)]
        np.testing.assert_array_equal(b.loss_targets[:n][inner], b.tokens[rows[inner], cols[inner] + 1])


def test_one_length_with_different_trained_counts_compiles_a_step_each(tiny_model):
    records = [{"prompt": "a" * 40, "completion": "b"}, {"prompt": "a", "completion": "b" * 40}]
    examples = load_examples(jsonl(records), tiny_model.tokenizer, 64)
    run = SFTRun(tiny_model.params, tiny_model.config, examples, SFTConfig(lora_rank=4, batch_size=1, n_epochs=2))
    while not run.done:
        run.advance()
    assert run.shapes == {(1, 48, 32), (1, 48, 48)}  # same rows and length, trained positions bucketed apart


def test_training_never_copies_the_base_weights(tiny_model):
    examples = load_examples(jsonl([{"prompt": "ab", "completion": "cd"}] * 4), tiny_model.tokenizer, 64)
    config = SFTConfig(lora_rank=4, batch_size=2, n_epochs=1)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tiny_model.params)]
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(tiny_model.params))
    before = sum(x.nbytes for x in jax.live_arrays())
    run = SFTRun(tiny_model.params, tiny_model.config, examples, config)
    while not run.done:
        run.advance()
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(run.params)] == pointers
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((run.lora, run.opt_state)))
    grown = sum(x.nbytes for x in jax.live_arrays()) - before
    assert grown <= state_bytes + 4096 < base_bytes  # LoRA params and optimizer state only


def serve_greedy(model, store, name, prompt_ids, max_tokens):
    engine = AsyncEngine(model, EngineConfig(num_kv_blocks=32, block_size=16, max_loras=2, max_lora_rank=8,
                                             decode_row_buckets=(1, 2), prefill_token_buckets=(16, 32, 64),
                                             max_num_seqs=2, max_num_batched_tokens=64))
    try:
        adapter = AdapterRegistry(engine, store).load(name).weights if name else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
        [[choice]] = engine.complete([prompt_ids], params, adapter, timeout=120)
        return choice.token_ids, choice.logprobs
    finally:
        engine.shutdown()


def test_sft_teaches_a_reply_that_the_engine_serves(expressive_model, tmp_path):
    tiny_model = expressive_model
    questions = ["hello", "what is this?", "who are you", "tell me a joke", "ping", "name a colour", "2+2", "bye"]
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]}
                            for q in questions]))
    valid = jsonl([{"messages": [{"role": "user", "content": "good morning"},
                                 {"role": "assistant", "content": REPLY}]}])
    store = AdapterStore(tmp_path / "store")
    result = sft(str(train), "hi-adapter", model=tiny_model, validation=valid, store=store, progress=False,
                 config=SFTConfig(lora_rank=8, lora_alpha=16.0, learning_rate=1e-2, n_epochs=12, batch_size=4,
                                  warmup_ratio=0.1, max_seq_len=64))
    history = result.history
    assert len(history) == 24 and [h["step"] for h in history] == list(range(1, 25))
    assert history[-1]["train_loss"] < 0.1 * history[0]["train_loss"]
    assert history[-1]["valid_loss"] < 0.2 * history[1]["valid_loss"]
    assert history[-1]["valid_mean_token_accuracy"] > 0.9
    assert "valid_loss" in history[1] and "valid_loss" not in history[0]  # at each epoch's end
    assert result.compiled_shapes == 1
    assert history[0]["learning_rate"] < history[2]["learning_rate"] > history[-1]["learning_rate"]

    artifact = result.artifact
    m = artifact.manifest
    assert (m.name, m.rank, m.alpha, m.base_model.id) == ("hi-adapter", 8, 16.0, "tiny-llama")
    assert m.provenance.source == "training:sft" and m.training["steps"] == 24
    assert [i["purpose"] for i in m.training_inputs] == ["training", "validation"]
    assert m.config["learning_rate"] == 1e-2
    np.testing.assert_array_equal(load_weights(artifact)["q_proj"]["b"], result.run.weights()["q_proj"]["b"])

    tok = tiny_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "ping"}]))
    expected = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    served, served_logprobs = serve_greedy(tiny_model, store, "hi-adapter", prompt, len(expected))
    assert served == expected
    assert serve_greedy(tiny_model, store, None, prompt, len(expected))[0] != expected  # the base model did not know

    # exported to PEFT, transformers + peft gives the same greedy tokens and logprobs
    import torch
    from peft import PeftModel
    from peft_adapters import reference_greedy
    from tiny_models import make_hf_model

    from kiln.adapters import peft_io

    out = peft_io.write_peft(tmp_path / "peft", load_weights(artifact), m.rank, m.alpha, m.use_rslora, m.base_model.id)
    hf = make_hf_model("llama", vocab_size=260, seed=3, initializer_range=0.25)  # the expressive model's twin
    reference = PeftModel.from_pretrained(hf, str(out)).eval()
    assert reference_greedy(reference, prompt, len(expected)) == expected
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + expected])).logits[0, len(prompt) - 1:-1]
    ref_logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(expected)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(served_logprobs, ref_logprobs, atol=1e-4, rtol=0)


def test_kiln_train_sft_from_the_shell(expressive_model, kiln_cache, tmp_path):
    import os
    import subprocess
    import sys

    data = tmp_path / "train.jsonl"
    data.write_text(jsonl([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]}
                           for q in ("hello", "ping", "bye", "who are you")]))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, "KILN_CACHE_DIR": str(kiln_cache),
           "KILN_MODEL_PATH": expressive_model.source, "KILN_ADAPTERS_STORE": str(tmp_path / "store")}
    args = ["--data", str(data), "--name", "shell-adapter", "--epochs", "2", "--batch-size", "2", "--rank", "4",
            "--learning-rate", "0.01", "--max-seq-len", "64"]
    proc = subprocess.run([sys.executable, "-m", "kiln", "train", "sft", *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["artifact"]["name"] == "shell-adapter" and out["artifact"]["rank"] == 4
    assert [h["step"] for h in out["history"]] == [1, 2, 3, 4] and out["compiled_shapes"] >= 1
    assert AdapterStore(tmp_path / "store").latest("shell-adapter").manifest.config["n_epochs"] == 2
    bad = subprocess.run([sys.executable, "-m", "kiln", "train", "sft", *args[:1], str(tmp_path / "missing.jsonl"),
                          *args[2:]], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "missing.jsonl" in bad.stdout + bad.stderr


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_sft_on_quantized_weights_teaches_a_reply_served_on_them(expressive_model, kiln_cache, tmp_path, quantization):
    """QLoRA: the base frozen in int8 or int4 (kiln.models.quant), the LoRA params and optimizer state in
    float32; the adapter serves on the quantized base it was trained on."""
    q8 = load_model(expressive_model.source, show_progress=False, quantization=quantization, model_id="tiny-llama")
    questions = ["hello", "what is this?", "who are you", "tell me a joke", "ping", "name a colour", "2+2", "bye"]
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": REPLY}]}
                            for q in questions]))
    store = AdapterStore(tmp_path / "store")
    result = sft(str(train), "q8-adapter", model=q8, store=store, progress=False,
                 config=SFTConfig(lora_rank=8, lora_alpha=16.0, learning_rate=1e-2, n_epochs=12, batch_size=4,
                                  warmup_ratio=0.1, max_seq_len=64))
    assert result.history[-1]["train_loss"] < 0.1 * result.history[0]["train_loss"]
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves((result.run.lora, result.run.opt_state))
               if np.issubdtype(leaf.dtype, np.floating))
    tok = q8.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "ping"}]))
    expected = tok.encode(REPLY, add_special_tokens=False) + [tok.eos_token_id]
    assert serve_greedy(q8, store, "q8-adapter", prompt, len(expected))[0] == expected
