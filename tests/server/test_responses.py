"""The Responses API through the real server, driven by the official openai client: whole and
streamed responses, stored responses and `previous_response_id`, function tools, logprobs, and
bad input. A response is a chat request underneath, so at temperature 0 its text must be the
chat completion's for the same conversation."""

import json
import re
import time

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


def test_a_required_call_cut_by_max_output_tokens_ends_incomplete_with_its_arguments_so_far(client):
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[CITY], tool_choice="required",
              parallel_tool_calls=False, temperature=0)
    whole = client.responses.create(max_output_tokens=120, **kw)
    [call] = whole.output
    assert whole.status == "completed" and call.type == "function_call"
    # (the tiny model writes a character a token: its last four close the call)
    cut = client.responses.create(max_output_tokens=whole.usage.output_tokens - 4, **kw)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    [part] = cut.output
    assert (part.type, part.name, part.status) == ("function_call", call.name, "incomplete")
    assert call.arguments.startswith(part.arguments) and len(part.arguments) < len(call.arguments)


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


# ---- agent runs: tools Kiln runs itself ---------------------------------------------------------

MULTIPLY = {"type": "kiln_python", "name": "multiply", "description": "Multiplies two numbers",
            "parameters": {"type": "object", "properties": {"a": {"enum": [12, 34]}, "b": {"enum": [56, 78]}},
                           "required": ["a", "b"]},
            "source": "def multiply(a, b):\n    return a * b\n"}


def agent(client, tools, choice, **kw):
    return client.responses.create(model=MODEL, input="Use the tool.", tools=tools, temperature=0,
                                   tool_choice=choice, **kw)


def prompt_tokens(server, messages, tools):
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in tools]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": chat_tools}, timeout=30)
    return r.json()["count"]


def test_a_kiln_python_tool_runs_in_the_sandbox_and_its_output_is_the_next_turns_input(server, client):
    r = agent(client, [MULTIPLY], {"type": "function", "name": "multiply"}, max_tool_calls=1)
    call, output, again = r.output
    assert (call.type, output.type, again.type) == ("function_call", "function_call_output", "function_call")
    args = json.loads(call.arguments)
    assert output.call_id == call.call_id and output.output == str(args["a"] * args["b"])
    # the second turn continued the first one's tokens (the model's text verbatim), then read the
    # tool's output: usage counts both turns' prompts, and the second found the first in the prefix cache
    user = [{"role": "user", "content": "Use the tool."}]
    first = prompt_tokens(server, user, [MULTIPLY])
    second = prompt_tokens(server, user + [{"role": "assistant", "content": call.arguments},
                                           {"role": "tool", "tool_call_id": call.call_id, "content": output.output}],
                           [MULTIPLY])
    assert r.usage.input_tokens == first + second and r.usage.input_tokens_details.cached_tokens > 0
    # the limit ended it: the third call never ran
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_tool_calls"


def test_a_failing_or_slow_tool_reaches_the_model_as_an_error(client):
    boom = {"type": "kiln_python", "name": "boom", "parameters": {"type": "object", "properties": {}},
            "source": "def boom():\n    raise ValueError('no luck')\n"}
    slow = {"type": "kiln_python", "name": "nap", "timeout_s": 1, "parameters": {"type": "object", "properties": {}},
            "source": "import time\ndef nap():\n    time.sleep(30)\n"}
    for tool, said in ((boom, "ValueError: no luck"), (slow, "did not return within 1 s")):
        r = agent(client, [tool], {"type": "function", "name": tool["name"]}, max_tool_calls=1)
        output = r.output[1]
        assert output.type == "function_call_output" and output.output.startswith("error:") and said in output.output
        assert r.status == "incomplete"  # not a 5xx: the run went on to its next turn


def test_a_tool_loop_stops_at_the_turn_limit(client):
    r = agent(client, [MULTIPLY], "required", parallel_tool_calls=False, extra_body={"max_turns": 3})
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_turns" and len(calls) == 3
    assert len([i for i in r.output if i.type == "function_call_output"]) == 3
    # with no limit of its own, this tiny model's 256-token context ends the loop
    r = agent(client, [MULTIPLY], "required")
    assert r.status == "incomplete" and r.incomplete_details.reason == "context_length" and len(r.output) > 4


@pytest.fixture(scope="module")
def mcp_url():
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parents[1] / "mcp_server.py"
    proc = subprocess.Popen([sys.executable, str(script), "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def mcp_tool(**kw):
    return {"type": "mcp", "server_label": "calc", "require_approval": "never", **kw}


def test_an_mcp_tool_over_http_lists_calls_and_streams(client, mcp_url):
    tools = [mcp_tool(server_url=mcp_url, allowed_tools=["add", "fail"])]
    r = agent(client, tools, {"type": "mcp", "server_label": "calc", "name": "add"}, max_tool_calls=1)
    listing, call, _ = r.output
    assert listing.type == "mcp_list_tools" and sorted(t.name for t in listing.tools) == ["add", "fail"]
    args = json.loads(call.arguments)
    assert call.type == "mcp_call" and call.name == "add" and call.server_label == "calc"
    assert call.output == str(args["a"] + args["b"]) and call.error is None and call.status == "completed"
    failed = agent(client, tools, {"type": "function", "name": "fail"}, max_tool_calls=1).output[1]
    assert failed.status == "failed" and "it broke" in failed.error.content[0]["text"]
    # streamed: the call's arguments, then its run, then the item done with its output
    events = list(client.responses.create(model=MODEL, input="Use the tool.", tools=tools, temperature=0,
                                          tool_choice={"type": "function", "name": "add"}, max_tool_calls=1,
                                          stream=True))
    types = [e.type for e in events]
    first_call = types.index("response.mcp_call_arguments.delta")
    assert types[first_call - 1] == "response.output_item.added"
    assert types.index("response.mcp_call_arguments.done") < types.index("response.mcp_call.in_progress") \
        < types.index("response.mcp_call.completed")
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "mcp_call"]
    assert done[0].output == events[-1].response.output[1].output and types[-1] == "response.incomplete"


def test_an_mcp_tool_over_stdio_and_its_timeout(client):
    import sys
    from pathlib import Path

    command = [sys.executable, str(Path(__file__).parents[1] / "mcp_server.py"), "stdio"]
    r = agent(client, [mcp_tool(command=command, timeout_s=1)], {"type": "function", "name": "slow"},
              max_tool_calls=1)
    call = r.output[1]
    assert call.type == "mcp_call" and call.status == "failed" and "did not answer within 1 s" in call.error.content[0][
        "text"]
    r = agent(client, [mcp_tool(command=command)], {"type": "function", "name": "add"}, max_tool_calls=1)
    assert r.output[1].status == "completed" and r.output[1].output in {"7", "9", "8", "10"}


@pytest.mark.parametrize("tool, param", [
    ({"type": "kiln_python", "name": "f", "source": "def f(:\n"}, "tools[0].source"),
    ({"type": "kiln_python", "name": "f", "source": "def g():\n    pass\n"}, "tools[0].source"),
    ({"type": "kiln_python", "source": "def f():\n    pass\n"}, "tools[0].name"),
    ({"type": "kiln_python", "name": "f", "source": "def f(): pass", "timeout_s": 0}, "tools[0].timeout_s"),
    (mcp_tool(server_url="http://127.0.0.1:9/mcp"), "tools[0].server_url"),
    (mcp_tool(command=["/nonexistent/mcp-server"]), "tools[0].command"),  # allowed, but it does not start
    (mcp_tool(command="/bin/sh -c 'echo hi'"), "tools[0].command"),  # not in the server's mcp_commands
    (mcp_tool(), "tools[0].server_url"),
    (mcp_tool(server_url="http://127.0.0.1:9/mcp", require_approval="always"), "tools[0].require_approval"),
])
def test_bad_agent_tools_are_a_400_naming_the_field(server, tool, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", "tools": [tool]}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if "sh -c" in str(tool.get("command")):
        assert "mcp_commands" in r.json()["error"]["message"]


def finished_requests(server) -> dict[str, float]:
    """The engine's finished requests by reason (each agent turn is one)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {reason: sum(float(m) for m in re.findall(
        rf'^vllm:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}} (\S+)$', text, re.M))
        for reason in ("stop", "length", "abort")}


def test_a_client_that_leaves_a_whole_response_stops_its_agent_run(server):
    """Not streamed: the run's turns stop when its client hangs up, in the middle of a tool call,
    instead of going on to the context's end."""
    nap = {"type": "kiln_python", "name": "nap", "timeout_s": 30, "parameters": {"type": "object", "properties": {}},
           "source": "import time\ndef nap():\n    time.sleep(1)\n    return 'rested'\n"}
    before = sum(finished_requests(server).values())
    cancelled = agent_metric(server, "kiln:agent_runs_total", status="cancelled")
    body = {"model": MODEL, "input": "Rest.", "tools": [nap], "tool_choice": "required", "temperature": 0,
            "parallel_tool_calls": False}
    with pytest.raises(httpx.ReadTimeout):  # the client leaves during the first tool call
        httpx.post(server.url + "/v1/responses", json=body, timeout=httpx.Timeout(30, read=0.6))
    time.sleep(4)  # long enough for two more turns and naps, had the run gone on
    assert sum(finished_requests(server).values()) - before == 1  # the first turn only
    assert agent_metric(server, "kiln:agent_runs_total", status="cancelled") == cancelled + 1
    # the same run, waited for, goes on turn after turn to the context's end
    done = httpx.post(server.url + "/v1/responses", json=body, timeout=120).json()
    assert done["incomplete_details"]["reason"] == "context_length" and len(done["output"]) > 4


def agent_metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": MODEL, **labels}.items()))
    found = re.search(rf"^{re.escape(name)}{{{re.escape(label_text)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_agent_runs_and_their_tool_calls_are_counted_on_metrics(server, client):
    boom = {"type": "kiln_python", "name": "boom", "parameters": {"type": "object", "properties": {}},
            "source": "def boom():\n    raise ValueError('no luck')\n"}
    names = [("kiln:agent_runs_total", {"status": "incomplete"}),
             ("kiln:agent_run_turns_count", {}), ("kiln:agent_run_turns_sum", {}),
             ("kiln:agent_tool_calls_total", {"tool_type": "kiln_python", "outcome": "ok"}),
             ("kiln:agent_tool_calls_total", {"tool_type": "kiln_python", "outcome": "error"}),
             ("kiln:agent_tool_seconds_count", {"tool_type": "kiln_python"})]
    before = [agent_metric(server, n, **labels) for n, labels in names]
    agent(client, [MULTIPLY], {"type": "function", "name": "multiply"}, max_tool_calls=1)  # 2 turns, 1 call
    agent(client, [boom], {"type": "function", "name": "boom"}, max_tool_calls=1)  # 2 turns, 1 failed call
    client.responses.create(model=MODEL, input="hi", max_output_tokens=2)  # no tool Kiln runs: not an agent run
    after = [agent_metric(server, n, **labels) for n, labels in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2, 4, 1, 1, 2]
