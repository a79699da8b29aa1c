"""The openai client against the daemon started as `make serve` starts it (`hetserve serve`, default
configuration, its own process): `parse` with a pydantic model, a tool-calling loop (call -> result ->
answer), streamed tool calls; and the parsing of tool calls from text, without a model."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from server.structured import ToolCallStream, Tools, parse_calls, tool_message
from tests.conftest import free_port, wait_healthy

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class Pet(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`hetserve serve` in its own process with the default configuration (a smaller KV cache beside the
    other test servers); stopped with SIGTERM."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hetserve", "serve", "--port", str(port), "--kv-cache-bytes",
                                 "256MiB"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, log_path, timeout_s=300)
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield SimpleNamespace(url=url, model_name=name)
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(client, server):
    completion = client.beta.chat.completions.parse(
        model=server.model_name, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
        temperature=0, max_tokens=100)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and completion.choices[0].finish_reason == "stop"


def test_tool_calling_loop(client, server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=server.model_name, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    result = {"city": args.get("city", "Paris"), "temperature_c": 21, "sky": "sunny"}
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    answer = client.chat.completions.create(model=server.model_name, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="none", temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_named_tool_call_streams_its_arguments(client, server):
    stream = client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=40,
        stream=True)
    ids, name, args, reasons = set(), "", "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            ids.add(call.id) if call.id else None
            name += (call.function.name or "") if call.function else ""
            args += (call.function.arguments or "") if call.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert len(ids) == 1 and name == "get_weather" and reasons[-1] == "tool_calls"
    assert isinstance(json.loads(args)["city"], str)


def _tools(choice: str) -> Tools:
    return Tools({"get_weather": WEATHER["function"]["parameters"], "get_time": {}}, (WEATHER, TIME), choice)


def test_auto_tool_calls_parse_from_tags_and_stream_whole():
    tools = _tools("auto")
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert parse_calls(tools, text) == ([("get_weather", '{"city": "Oslo"}')], "Let me check.")
    assert parse_calls(tools, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')[0] == []
    message, reason = tool_message(tools, text, "stop", "call_x_")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["tool_calls"][0]["id"] == "call_x_0"
    assert tool_message(tools, "Sunny.", "stop", "c") == ({"role": "assistant", "content": "Sunny."}, "stop")
    stream = ToolCallStream(tools, "c")
    pieces = ["<tool", '_call>{"name": "get_time", ', '"arguments": {}}', "</tool_call>"]
    assert [stream.delta(p) for p in pieces] == [{}] * 4
    last, reason = stream.finish("stop")
    assert reason == "tool_calls" and last["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    plain = ToolCallStream(tools, "c")
    assert plain.delta(" <t") == {} and plain.delta("ea time") == {"content": " <tea time"}
    assert plain.delta("!") == {"content": "!"} and plain.finish("stop") == ({}, "stop")


def test_required_calls_are_a_json_list():
    tools = _tools("required")
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert parse_calls(tools, text)[0] == [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]
    assert tool_message(tools, text[:20], "length", "c") == ({"role": "assistant", "content": text[:20]}, "length")
    schema = json.loads(tools.grammar().text)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
