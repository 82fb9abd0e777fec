"""The Responses API through the real server, driven by the official openai client: whole and
streamed responses, stored responses and `previous_response_id`, function tools, logprobs, and
bad input. A response is a chat request underneath, so at temperature 0 its text must be the
chat completion's for the same conversation."""

import json

import httpx
import openai
import pytest

MODEL = "tiny-llama"
CITY = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's shared tiny-model server (served as MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_a_response_is_the_chat_completion_of_its_input_and_is_stored(client):
    r = client.responses.create(model=MODEL, input="hello there", instructions="Be brief.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    text, usage = chat_text(client, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hello there"}], 12)
    assert r.output_text == text
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    assert r.status == ("incomplete" if usage.completion_tokens == 12 else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.store is True and r.model_extra["kiln"]["lineage"]["model"] == MODEL
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()


def test_streamed_events_build_the_same_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": "tell me a story"}], max_output_tokens=10,
              temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert events[2].item.id == final.output[0].id == events[-2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed response is stored


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="hi", instructions="Only here.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the earlier turns are the context; the earlier instructions are not carried over
    text, usage = chat_text(client, [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "and then?"}], 6)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id and second.instructions is None
    items = list(client.responses.input_items.list(second.id))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "and then?")]
    page = client.responses.input_items.list(first.id, order="asc", limit=1)
    assert page.data[0].content[0].text == "hi" and page.has_more is False


def test_function_call_and_its_output_round_trip(client):
    call_r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[CITY], tool_choice=NAMED,
                                     max_output_tokens=32, temperature=0)
    [call] = call_r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Lyon") and call_r.status == "completed"
    answer = client.responses.create(
        model=MODEL, previous_response_id=call_r.id, tools=[CITY], max_output_tokens=6, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    text, _ = chat_text(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}], 6)
    assert answer.output_text == text
    # the same call streamed: argument deltas, then the call done, through the SDK's accumulating stream
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[CITY], tool_choice=NAMED,
                                 max_output_tokens=32, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output[0].arguments == call.arguments


def test_logprobs_are_included_on_request(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=5, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=5, temperature=0)
    assert not plain.output[0].content[0].logprobs


def test_delete_and_store_false(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and err.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [CITY]}, "tool_choice"),
    ({"input": "hi", "top_logprobs": 30}, "top_logprobs"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "x" * 5000}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_stored_response_is_a_404(server):
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        r = httpx.request(method, server.url + path, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 404 and error["param"] == "response_id", (method, path, r.text)
        assert error["code"] == "response_not_found" and error["type"] == "not_found_error"


# ---- the translation, without a server ----------------------------------------------------------

CALLS_TEXT = ('<think>plan it</think>Let me check.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call><tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_output_items_open_and_close_in_order_whole_or_streamed(pieces):
    from kiln.server.chat_output import OutputReader
    from kiln.server.responses_api import OutputItems

    out = OutputItems(OutputReader(reasoning=True, tool_mode="auto", tool_format="hermes"), None, False)
    chunks = [CALLS_TEXT[i:i + pieces] for i in range(0, len(CALLS_TEXT), pieces)]
    events = [e for i, c in enumerate(chunks) for e in out.feed(c, None, final=i == len(chunks) - 1)]
    items = out.items
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "plan it" and items[1]["content"][0]["text"] == "Let me check."
    assert [(i["name"], json.loads(i["arguments"])) for i in items[2:]] == [("weather", {"city": "Paris"}),
                                                                            ("time", {})]
    assert all(i["status"] == "completed" for i in items)
    # each item is added once and done once, in order, and its deltas add up to its final form
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == items
    joined = {}
    for e in events:
        if e["type"].endswith(".delta"):
            joined[e["output_index"]] = joined.get(e["output_index"], "") + e["delta"]
    assert joined == {0: "plan it", 1: "Let me check.", 2: items[2]["arguments"], 3: items[3]["arguments"]}


def test_items_become_chat_messages():
    from kiln.server.responses_api import chat_messages, input_items

    items = input_items([
        {"role": "developer", "content": "be exact"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ])
    assert all(i["id"] for i in items)
    messages = chat_messages("short answers", items)
    assert [(m.role, m.content) for m in messages] == [
        ("system", "short answers"), ("system", "be exact"), ("user", "weather ?"), ("assistant", None),
        ("tool", "sunny"), ("tool", "noon")]
    assert [c["id"] for c in messages[3].tool_calls] == ["c1", "c2"] and messages[3].reasoning_content == "hm"
    assert [m.tool_call_id for m in messages[4:]] == ["c1", "c2"]
