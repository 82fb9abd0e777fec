"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loader."""

import time

import numpy as np
import pytest
import torch

from kiln.models.generate import greedy_generate
from kiln.models.loader import DEFAULT_MODEL_ID, default_model_path, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five year old.",
    "List three prime numbers greater than 50.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def kiln_model(kiln_cache):
    return load_model(show_progress=False)


@pytest.fixture(scope="module")
def reference(default_hf_tokenizer):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    tok = default_hf_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(model, ids, n):
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=x, cache=past, use_cache=True)
            past = res.cache
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


def chat_ids(tok, prompt):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


def test_default_model_identity(kiln_model):
    cfg = kiln_model.config
    assert kiln_model.model_id == DEFAULT_MODEL_ID
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert len(kiln_model.weights_digest) == 64


def test_greedy_tokens_equal_transformers(kiln_model, reference):
    _, hf = reference
    prompts = [chat_ids(kiln_model.tokenizer, p) for p in PROMPTS]
    ours = greedy_generate(kiln_model.params, kiln_model.config, prompts, NEW_TOKENS)  # one batch
    for ids, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, ids, NEW_TOKENS), kiln_model.tokenizer.decode(got)


def test_prompt_logits_close_to_transformers(kiln_model, reference):
    from conftest import jit_forward

    from kiln.models.batch import RowWork, build_step_inputs
    from kiln.models.decoder import init_kv_cache

    _, hf = reference
    ids = chat_ids(kiln_model.tokenizer, PROMPTS[0])
    kv = init_kv_cache(kiln_model.config, 4, 16)
    step = build_step_inputs([RowWork(ids, 0, [3, 1, 2])], 16)
    logits, _ = jit_forward(kiln_model.params, kv, step, kiln_model.config)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.asarray(logits) - ref).max() < 1e-3


def test_tokenizer_and_chat_template_equal_transformers(kiln_model, reference):
    tok, _ = reference
    ours = kiln_model.tokenizer
    texts = [
        "Hello world 123",
        "  multiple   spaces\n\n\tnewline and tab",
        "émoji 🎉 ok — ünïcödé 中文 日本語",
        "def f(x):\n    return x ** 2  # comment",
        "The year 2024! Prices: $3.50, 1e-5, 0x1F",
        "<|im_start|>user\nspecial tokens inline<|im_end|>",
    ]
    for text in texts:
        assert ours.encode(text) == tok.encode(text, add_special_tokens=True), text
        assert ours.decode(ours.encode(text)) == tok.decode(tok.encode(text))
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )


def test_second_load_uses_the_converted_cache(kiln_model, kiln_cache):
    from kiln.models.loader import cache_dir

    entry = cache_dir() / "converted" / kiln_model.weights_digest[:32]
    stamp = (entry / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = load_model(show_progress=False)
    print(f"second load: {time.perf_counter() - start:.2f}s")
    assert (entry / "model.safetensors").stat().st_mtime_ns == stamp
    assert again.weights_digest == kiln_model.weights_digest
