"""Structured outputs and tool calls through the real server on the default model, driven by the
official openai client (and instructor, unchanged)."""

import json
import time

import httpx
import instructor
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_process import ServerProcess

from kiln.models.loader import DEFAULT_MODEL_ID

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(kiln_cache):
    # the default model with a small step set (8 executables): its first start builds them
    srv = ServerProcess("", str(kiln_cache), KILN_SERVER_GRAMMAR_COMPILE_TIMEOUT_S="0.5",
                        KILN_ENGINE_DECODE_ROW_BUCKETS="1,4", KILN_ENGINE_PREFILL_TOKEN_BUCKETS="64",
                        KILN_ENGINE_MAX_NUM_SEQS="4", KILN_ENGINE_MAX_NUM_BATCHED_TOKENS="64")
    yield srv
    srv.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=DEFAULT_MODEL_ID, **{"messages": ASK, "max_tokens": 48, **kw})


def test_parse_returns_a_pydantic_object(client):
    r = client.chat.completions.parse(model=DEFAULT_MODEL_ID, response_format=Person, max_tokens=48, temperature=0,
                                      messages=[{"role": "user", "content": "Invent a person with a name and age."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"guided_json": Person.model_json_schema()}},
    {"extra_body": {"structured_outputs": {"json": Person.model_json_schema()}}},
])
def test_json_constraints_chat(client, body):
    ask = [{"role": "user", "content": "Reply in JSON: the name and age of a person you invent."}]
    r = chat(client, messages=ask, temperature=0.7, seed=4, n=2, max_tokens=64, **body)
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished  # a choice that runs out of tokens (finish_reason length) may end mid-JSON
    for choice in finished:
        value = json.loads(choice.message.content)
        assert isinstance(value, dict)
        if "extra_body" in body:
            jsonschema.validate(value, Person.model_json_schema())


def test_regex_choice_and_grammar_on_completions_streamed_and_whole(client):
    prompt = "The date of the moon landing, written as YYYY-MM-DD:"
    r = client.completions.create(model=DEFAULT_MODEL_ID, prompt=prompt, max_tokens=16, temperature=0.8,
                                  extra_body={"structured_outputs": {"regex": r"19[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 10 and r.choices[0].text.startswith("19")
    stream = client.completions.create(model=DEFAULT_MODEL_ID, prompt="The sky is", max_tokens=8, stream=True,
                                       extra_body={"guided_choice": ["blue", "green", "red"]})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("blue", "green", "red")
    r = client.completions.create(model=DEFAULT_MODEL_ID, prompt="2 + 2 =", max_tokens=8,
                                  extra_body={"guided_grammar": 'start: " " ANSWER\nANSWER: /[0-9]/'})
    assert len(r.choices[0].text) == 2 and r.choices[0].text[1].isdigit()


def test_tool_choice_required_whole_and_streamed(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    chunks = list(chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                       parallel_tool_calls=False, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].id == deltas[0][0].id and deltas[0][0].function.name == call.function.name
    assert "".join(d[0].function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_cut_by_max_tokens_keeps_the_call_so_far(client):
    kw = dict(tools=[WEATHER], tool_choice="required", temperature=0, parallel_tool_calls=False)
    [call] = chat(client, **kw).choices[0].message.tool_calls
    r = chat(client, max_tokens=14, **kw)  # the name written, the arguments begun
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [part] = choice.message.tool_calls
    assert part.function.name == call.function.name and call.function.arguments.startswith(part.function.arguments)
    assert len(part.function.arguments) < len(call.function.arguments)
    chunks = [c for c in chat(client, max_tokens=14, stream=True, **kw) if c.choices]
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == call.function.name and len(deltas) > 1  # the arguments come in pieces
    assert "".join(d.function.arguments or "" for d in deltas) == part.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def test_named_tool_choice_streams_argument_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=named, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = [c for c in chat(client, tools=[WEATHER], tool_choice=named, temperature=0, stream=True) if c.choices]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) > 2 and deltas[0].id and all(d.id is None for d in deltas[1:])  # arguments come in pieces
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)"\}\}\n</tool_call>'


def test_auto_reads_the_models_own_tool_call_format(client):
    # the default model's template writes no tools, so a regex makes it answer in Hermes format:
    # what `auto` must read back as a tool call, whole and streamed
    body = {"structured_outputs": {"regex": HERMES_CALL}}
    r = chat(client, tools=[WEATHER], tool_choice="auto", extra_body=body)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lyon")
    chunks = [c for c in chat(client, tools=[WEATHER], extra_body=body, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [t.function.name for t in calls] == ["get_weather"] and not any(c.choices[0].delta.content for c in chunks)
    plain = chat(client, tools=[WEATHER], tool_choice="none", extra_body=body)  # none: it stays text
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content


def test_tool_results_round_trip(client):
    first = chat(client, tools=[WEATHER], tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=messages, tools=[WEATHER], max_tokens=16)
    assert r.choices[0].message.content


def test_instructor_runs_unchanged(client):
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        person = patched.chat.completions.create(
            model=DEFAULT_MODEL_ID, response_model=Person, max_tokens=48, temperature=0, max_retries=0,
            messages=[{"role": "user", "content": "Extract: Ada Lovelace was 36."}])
        assert isinstance(person, Person)


def test_responses_parse_returns_a_pydantic_object(client):
    r = client.responses.parse(model=DEFAULT_MODEL_ID, input="Invent a person with a name and age.",
                               text_format=Person, max_output_tokens=48, temperature=0)
    assert isinstance(r.output_parsed, Person) and r.status == "completed"


def test_openai_agents_sdk_runs_a_function_tool_on_its_default_responses_path(server):
    import agents

    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"It is 21 degrees and sunny in {city}."

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                                        max_retries=0), use_for_tracing=False)
    agent = agents.Agent(name="weather", instructions="Answer using the weather tool.", tools=[get_weather],
                         model=DEFAULT_MODEL_ID,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(called) == 1 and called[0]
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_schema_too_slow_to_compile_is_a_bounded_400(server, client):
    names = [f"p{i}" for i in range(30000)]
    huge = {"type": "object", "required": names, "properties": {
        name: {"type": "string", "pattern": f"^[a-z]{{1,{i % 13 + 2}}}x{i}$"} for i, name in enumerate(names)}}
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, "response_format": {
                       "type": "json_schema", "json_schema": {"name": "huge", "schema": huge}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert time.monotonic() - start < 10
    assert chat(client, max_tokens=4).choices[0].message.content is not None  # the engine kept serving
