"""Constrained decoding in the engine, and reading chat output (reasoning, tool calls).

An untrained model is the hardest case for a grammar: every output it finishes must still
validate. The engine runs the grammars under sampling parameters, n > 1, stop strings,
preemption and prefix-cache hits; the readers are checked for prefix-stable streaming.
"""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import SMALL, run

from kiln.engine.client import AsyncEngine
from kiln.engine.config import EngineConfig
from kiln.engine.grammar import GrammarSpec
from kiln.engine.params import SamplingParams, ThinkingBudget
from kiln.errors import InvalidRequest
from kiln.models.tokenizer import KilnTokenizer
from kiln.server.chat_output import OutputReader, StreamedChoice, choose_parser
from kiln.server.schemas import ChatMessage, message_dicts
from kiln.server.structured import closed


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=64, **SMALL))
    yield eng
    eng.shutdown()


# ---- random schemas and regexes ------------------------------------------------------------

LEAVES = st.sampled_from([
    {"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {"type": "number"},
    {"type": "string", "maxLength": 6}, {"enum": ["red", "green", 3]}, {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "string", "pattern": "^[a-c]{2,4}$"}, {"const": "fixed"},
])


def _objects(children):
    return st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _objects(children), st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children,
                                  st.integers(0, 3)),
    st.lists(children, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts})), max_leaves=6)

REGEXES = st.lists(st.sampled_from([r"[0-9]{1,3}", r"(yes|no)", r"[a-f]+", r"-", r"\.", r"[A-Z][a-z]{0,4}", r" ",
                                    r"(ab)*c"]), min_size=1, max_size=5).map("".join)

SAMPLING = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]), "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, 5]), "min_p": st.sampled_from([0.0, 0.05]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]), "seed": st.integers(0, 2**31)})


def constrained(engine, spec, prompts, **params):
    """Every choice of every prompt, as (text, finish reason)."""
    grammar = engine._core.grammars.compile(spec)
    outs = engine.complete(prompts, SamplingParams(grammar=grammar, **params))
    return [(c.text, c.finish_reason) for choices in outs for c in choices]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, sampling=SAMPLING)
def test_every_finished_output_validates_against_its_schema(engine, schema, sampling):
    outs = constrained(engine, GrammarSpec("json", schema), [[5, 6, 7], [40, 41]], max_tokens=96, n=2, **sampling)
    finished = 0
    for text, finish in outs:
        assert finish in ("stop", "length")
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
            finished += 1
    assert finished or len(text) > 40  # only a long output may run out of tokens


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(pattern=REGEXES, sampling=SAMPLING)
def test_every_finished_output_matches_its_regex(engine, pattern, sampling):
    for text, finish in constrained(engine, GrammarSpec("regex", pattern), [[9, 10, 11]], max_tokens=48, n=2,
                                    **sampling):
        assert re.fullmatch(pattern, text) or (finish == "length" and len(text) > 10), (pattern, text)


@pytest.fixture(scope="module")
def default_engine(kiln_cache):
    from kiln.models.loader import load_model

    eng = AsyncEngine(load_model(show_progress=False), EngineConfig(num_kv_blocks=64, **SMALL))
    yield eng
    eng.shutdown()


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, pattern=REGEXES, sampling=SAMPLING)
def test_the_default_model_follows_random_schemas_and_regexes(default_engine, schema, pattern, sampling):
    tok = default_engine._core.model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Answer in JSON."}]),
                        add_special_tokens=False)
    for text, finish in constrained(default_engine, GrammarSpec("json", schema), [prompt], max_tokens=64, n=2,
                                    **sampling):
        if finish == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert len(text) > 40
    for text, finish in constrained(default_engine, GrammarSpec("regex", pattern), [prompt], max_tokens=32,
                                    **sampling):
        assert re.fullmatch(pattern, text) or (finish == "length" and len(text) > 10), (pattern, text)


def test_choice_and_grammar(engine):
    outs = constrained(engine, GrammarSpec("choice", ["alpha", "beta", "gamma"]), [[5, 6]] * 4, max_tokens=8,
                       temperature=1.0, n=3)
    assert {t for t, _ in outs} <= {"alpha", "beta", "gamma"} and len(outs) == 12
    lark = 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'
    outs = constrained(engine, GrammarSpec("grammar", lark), [[7, 8]] * 3, max_tokens=32, temperature=1.0)
    for text, finish in outs:
        assert finish == "stop" and re.fullmatch(r"sum\(\d{1,2}(,\d{1,2})*\)", text), text


def test_grammars_hold_under_stops_preemption_and_prefix_hits(tiny_model):
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
              "required": ["k"], "additionalProperties": False}
    eng = AsyncEngine(tiny_model, EngineConfig(num_kv_blocks=12, **SMALL))
    try:
        prompt = list(range(3, 40))  # two full blocks: the second round hits the prefix cache
        for _ in range(2):
            outs = constrained(eng, GrammarSpec("json", schema), [prompt] * 6, max_tokens=40, temperature=1.0, seed=3)
            for text, finish in outs:
                if finish == "stop":
                    jsonschema.validate(json.loads(text), schema)
        snap = eng.snapshot
        assert snap["preemptions"] > 0 and snap["prefix_hits"] > 0
        # a stop string cuts the constrained output where it occurs
        outs = constrained(eng, GrammarSpec("json", schema), [prompt] * 4, max_tokens=40, stop=[","], temperature=1.0)
        for text, finish in outs:
            assert "," not in text and finish in ("stop", "length")
    finally:
        eng.shutdown()


def test_seeded_constrained_sampling_is_reproducible_and_batch_independent(engine):
    spec = GrammarSpec("json", {"type": "array", "items": {"type": "integer"}, "maxItems": 5})
    alone = constrained(engine, spec, [[5, 6, 7]], max_tokens=40, temperature=1.0, seed=11)
    together = constrained(engine, spec, [[5, 6, 7], [8, 9]], max_tokens=40, temperature=1.0, seed=11)
    assert alone[0] == together[0]


def test_unconstrained_batches_build_no_mask(engine):
    runner = engine._core.runner
    before = runner.layout.masks.steps
    run(engine, [[5, 6, 7], list(range(3, 60))], SamplingParams(max_tokens=4, temperature=0.5, top_k=3))
    assert runner.layout.masks.steps == before  # no mask was built, so none was sent or applied
    constrained(engine, GrammarSpec("regex", "[a-z]{3}"), [[5, 6, 7], [8]], max_tokens=4)
    assert runner.layout.masks.steps > before


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("json", {"type": "nonsense"}, "response_format.json_schema.schema"), "nonsense"),
    (GrammarSpec("json", "{not json", "guided_json"), "guided_json"),
    (GrammarSpec("regex", "(unclosed", "structured_outputs.regex"), "regex"),
    (GrammarSpec("grammar", "start: undefined_rule", "guided_grammar"), "undefined_rule"),
    (GrammarSpec("choice", [], "guided_choice"), "non-empty"),
])
def test_invalid_grammars_are_invalid_requests_naming_the_field(engine, spec, reason):
    with pytest.raises(InvalidRequest) as err:
        engine._core.grammars.compile(spec)
    assert err.value.param == spec.param and reason in str(err.value)


def test_grammars_are_compiled_once_per_source(engine):
    compiler = engine._core.grammars
    before = compiler.compiled
    for _ in range(3):
        compiler.compile(GrammarSpec("json", {"type": "object", "properties": {"z": {"type": "integer"}}}))
    assert compiler.compiled == before + 1


def test_thinking_budget_forces_the_end_of_thinking(engine, tiny_model):
    tok = tiny_model.tokenizer
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    prompts = [tok.encode("<think>", add_special_tokens=False) + [5, 6]] * 2
    outs = engine.complete(prompts, [SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True,
                                                    thinking=ThinkingBudget(7, end, "<think>", "</think>", opened=True))
                                  for s in (1, 2)])
    for [c] in outs:  # the prompt opened the block: 7 tokens of thinking, then </think>, then the answer
        assert tuple(c.token_ids[7:7 + len(end)]) == end and len(c.token_ids) == 30
    [[c]] = engine.complete([[5, 6]], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                                                     thinking=ThinkingBudget(0, end, "<think>", "</think>")))
    assert "</think>" not in c.text  # an answer that does not open a thinking block is left alone


# ---- reading chat output ---------------------------------------------------------------------

ARGS = {"city": "Paris", "days": 3}
TOOL_TEXTS = {
    "hermes": f'Let me check.<tool_call>\n{{"name": "weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>'
              f'<tool_call>\n{{"name": "time", "arguments": {{}}}}\n</tool_call>',
    "llama3_json": f'{{"name": "weather", "parameters": {json.dumps(ARGS)}}}; {{"name": "time", "parameters": {{}}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "weather", "arguments": {json.dumps(ARGS)}}}, '
               '{"name": "time", "arguments": {}}]',
}


def stream(reader, text, pieces=3):
    """Feeds text in chunks of `pieces` characters; returns the merged deltas."""
    choice, merged = StreamedChoice(reader), {"content": "", "reasoning_content": "", "calls": {}}
    chunks = [text[i:i + pieces] for i in range(0, len(text), pieces)] or [""]
    for i, chunk in enumerate(chunks):
        delta = choice.feed(chunk, final=i == len(chunks) - 1)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
    return merged


@pytest.mark.parametrize("fmt", sorted(TOOL_TEXTS))
def test_auto_tool_calls_are_read_in_each_format_whole_and_streamed(fmt):
    reader = OutputReader(tool_mode="auto", tool_format=fmt)
    msg = reader.message(TOOL_TEXTS[fmt])
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("weather", ARGS), ("time", {})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert msg["content"] == ("Let me check." if fmt == "hermes" else None)
    for pieces in (1, 4, 1000):
        merged = stream(reader, TOOL_TEXTS[fmt], pieces)
        assert [(c["name"], json.loads(c["arguments"])) for c in merged["calls"].values()] == calls
        assert merged["content"] == (msg["content"] or "")


def test_text_that_is_not_a_call_stays_content():
    for fmt, text in [("hermes", "I would say <tool_call> is a tag"), ("llama3_json", "{not json at all"),
                      ("mistral", "[TOOL_CALLS] garbage"), ("hermes", "plain <tool_ answer")]:
        reader = OutputReader(tool_mode="auto", tool_format=fmt)
        assert reader.message(text) == {"role": "assistant", "content": text}
        assert stream(reader, text, 2)["content"] == text


def test_required_and_named_calls():
    required = OutputReader(tool_mode="required")
    msg = required.message('[{"name":"weather","parameters":{"city":"Oslo"}},{"name":"time","parameters":{}}]')
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["weather", "time"]
    named = OutputReader(tool_mode="named", function="weather")
    merged = stream(named, '{"city":"Oslo"}', 2)
    assert merged["calls"] == {0: {"name": "weather", "arguments": '{"city":"Oslo"}'}}


def test_required_calls_stream_their_arguments_as_written_and_keep_them_when_cut_off():
    text = '[{"name": "weather", "parameters": {"city": "O\\"slo", "days": [1, {"n": 2}], "x": -1.5}}, ' \
           '{"name": "time", "parameters": {}}]'
    required = OutputReader(tool_mode="required")
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in required.message(text)["tool_calls"]]
    assert whole == [("weather", '{"city": "O\\"slo", "days": [1, {"n": 2}], "x": -1.5}'), ("time", "{}")]
    for pieces in (1, 3, 1000):  # every piece of the text: the calls' deltas join into the whole arguments
        merged = stream(required, text, pieces)
        assert [(c["name"], c["arguments"]) for c in merged["calls"].values()] == whole and not merged["content"]
    # cut off (max_tokens): the calls whose names were written, with their arguments so far
    for cut in range(len(text)):
        msg = required.message(text[:cut])
        calls = msg.get("tool_calls") or []
        assert len(calls) <= 2 and all(whole[i][1].startswith(c["function"]["arguments"]) for i, c in enumerate(calls))
        assert (msg["content"] is None) == bool(calls) and (calls or msg["content"] == text[:cut])
    assert required.message(text[:text.index("parameters")])["tool_calls"][0]["function"]["arguments"] == ""


def test_reasoning_is_split_out_whole_and_streamed():
    text = "<think>\nTwo and two.\n</think>\n\nFour."
    reader = OutputReader(reasoning=True)
    assert reader.message(text) == {"role": "assistant", "content": "Four.", "reasoning_content": "\nTwo and two.\n"}
    for pieces in (1, 5):
        merged = stream(reader, text, pieces)
        assert (merged["reasoning_content"], merged["content"]) == ("\nTwo and two.\n", "Four.")
    opened = OutputReader(reasoning=True, opens_in_reasoning=True)  # the prompt ended with <think>
    assert opened.message("hmm</think>ok") == {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}
    both = OutputReader(reasoning=True, tool_mode="auto", tool_format="hermes")
    msg = both.message('<think>call it</think><tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert msg["reasoning_content"] == "call it" and msg["tool_calls"][0]["function"]["name"] == "f"


def test_parser_choice_from_the_template():
    assert choose_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert choose_parser("auto", "<|start_header_id|>{{ '<|python_tag|>' }}") == "llama3_json"
    assert choose_parser("auto", "[TOOL_CALLS]") == "mistral"
    assert choose_parser("mistral", "<tool_call>") == "mistral"


QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
)


def test_tool_messages_round_trip_through_the_chat_template(tiny_model):
    tok = KilnTokenizer(tiny_model.tokenizer.tokenizer, {"chat_template": QWEN_LIKE})
    messages = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage(role="assistant", content=None, tool_calls=[
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": json.dumps(ARGS)}}]),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
    ]
    text = tok.apply_chat_template(message_dicts(messages), add_generation_prompt=False)
    assert f'<tool_call>\n{{"name": "weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>' in text
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in text
    # and what the template wrote reads back as the same call
    said = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    call = OutputReader(tool_mode="auto", tool_format="hermes").message(said)["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("weather", ARGS)


def test_tool_schemas_are_closed_without_changing_what_validates():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "properties": {"type": "integer"}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["properties"]
    jsonschema.validate({"a": {"b": "x"}, "properties": 1}, out)


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, kiln_cache):
    """The tiny llama served with a template whose prompt opens a <think> block (DeepSeek-R1 style)."""
    import tiny_models
    from server_process import ServerProcess

    template, tiny_models.CHAT_TEMPLATE = tiny_models.CHAT_TEMPLATE, THINKING_TEMPLATE
    try:
        path = tiny_models.write_gguf(tiny_models.make_hf_model("llama", vocab_size=260, seed=3),
                                      tmp_path_factory.mktemp("thinking") / "thinking.gguf")
    finally:
        tiny_models.CHAT_TEMPLATE = template
    srv = ServerProcess(str(path), str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME="thinker")
    yield srv
    srv.stop_cleanly()


def test_served_reasoning_is_split_out_and_budgeted(thinking_server):
    import openai

    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="thinker", messages=[{"role": "user", "content": "hi"}], temperature=0, seed=1,
               extra_body={"ignore_eos": True})
    unbounded = client.chat.completions.create(max_tokens=12, **ask).choices[0].message
    assert unbounded.reasoning_content and not unbounded.content  # still thinking when the tokens ran out
    budget = dict(max_tokens=24, **{**ask, "extra_body": {"ignore_eos": True, "thinking_token_budget": 6}})
    message = client.chat.completions.create(**budget).choices[0].message
    assert message.reasoning_content and message.content  # 6 tokens of thinking, </think> forced, then the answer
    assert unbounded.reasoning_content.startswith(message.reasoning_content)  # greedy: the same thinking, cut short
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **budget) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == message.reasoning_content
    assert "".join(d.content or "" for d in chunks) == message.content
