"""Structured outputs and tool calls at the HTTP edge: the grammar a request asks for, its tools laid out
in the prompt, and the model's output turned into OpenAI's `tool_calls`.

A request asks for at most one grammar: `response_format` (json_object, json_schema), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or a `tool_choice` that forces a
call (`required`: a JSON list of {"name", "arguments"}; a named function: its arguments alone).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.grammar import GrammarSpec
from server.protocol import APIError, ChatCompletionRequest, CommonParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
TOOL_TAG = "<tool_call>"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_request_error")


def _response_format(fmt: dict[str, Any]) -> GrammarSpec | None:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise _bad("response_format.json_schema must be an object with a name and a schema",
                       "response_format.json_schema")
        return GrammarSpec.json_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    raise _bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format.type")


def _guided(body: CommonParams) -> list[GrammarSpec]:
    specs = []
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise _bad(f"guided_json is not JSON: {exc}", "guided_json") from None
        specs.append(GrammarSpec.json_schema(schema, "guided_json"))
    if body.guided_regex is not None:
        specs.append(GrammarSpec("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        if not body.guided_choice or not all(body.guided_choice):
            raise _bad("guided_choice must list at least one non-empty string", "guided_choice")
        specs.append(GrammarSpec("choice", json.dumps(body.guided_choice), "guided_choice"))
    if body.guided_grammar is not None:
        specs.append(GrammarSpec("grammar", body.guided_grammar, "guided_grammar"))
    return specs


def request_grammar(body: CommonParams, tools: Tools | None = None) -> GrammarSpec | None:
    """The one grammar the request asks for, or None; 400 when it asks for more than one."""
    specs = _guided(body)
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        specs += [spec] if spec is not None else []
    if tools is not None and tools.grammar() is not None:
        specs.append(tools.grammar())
    if len(specs) > 1:
        raise _bad("ask for one of response_format, guided_json, guided_regex, guided_choice, guided_grammar or a "
                   f"forced tool_choice, not several ({', '.join(s.param for s in specs)})", specs[1].param)
    return specs[0] if specs else None


@dataclass(frozen=True)
class Tools:
    """A chat request's functions and its tool_choice."""

    functions: dict[str, dict]
    """name -> the function's parameters schema."""
    definitions: tuple[dict, ...]
    """The request's `tools`, as sent (for a chat template that renders them)."""
    choice: str
    """none, auto, required, or the name of the function to call."""
    is_parallel: bool = False
    """`required` may produce several calls: only when the request says parallel_tool_calls true (a small model
    given the choice tends to repeat its call until max_tokens)."""

    @property
    def is_forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def grammar(self) -> GrammarSpec | None:
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            return GrammarSpec.json_schema(self.functions[self.choice], "tools.function.parameters")
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, params in self.functions.items()]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.is_parallel else
                                                                                  {"maxItems": 1})}
        return GrammarSpec.json_schema(schema, "tools.function.parameters")

    def instructions(self) -> str:
        """A system prompt that lays out the tools, for a chat template that does not."""
        listed = json.dumps([{"name": n, "parameters": p} for n, p in self.functions.items()])
        text = f"You can call these functions: <tools>{listed}</tools>\n"
        if self.choice == "auto":
            return text + ('To call one, answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>; '
                           "otherwise answer the user.")
        if self.choice == "required":
            return text + 'Answer with a JSON list of calls: [{"name": NAME, "arguments": {...}}].'
        return text + f"Call {self.choice}: answer with its arguments as a JSON object."


def tool_setup(body: ChatCompletionRequest) -> Tools | None:
    """The request's validated tools and tool_choice; None when it has none (or tool_choice none)."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    functions: dict[str, dict] = {}
    for i, tool in enumerate(body.tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                       f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        functions[name] = params
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise _bad(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be none, auto, required or a named function, got {choice!r}", "tool_choice")
    if choice == "none":
        return None
    return Tools(functions, tuple(body.tools), choice, body.parallel_tool_calls is True)


def prompt_messages(messages: list[dict], tools: Tools | None, renders_tools: bool) -> list[dict]:
    """Messages for the chat template: without a template that renders tools, the tools as a system prompt, and
    earlier calls and results as text the model can read."""
    if renders_tools:
        return messages
    out = []
    for m in messages:
        content = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            fn = call.get("function", {})
            content += f'<tool_call>{{"name": {json.dumps(fn.get("name"))}, "arguments": {fn.get("arguments", "{}")}}}' \
                       "</tool_call>"
        if m["role"] == "tool":
            content = f"<tool_response>{content}</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools.instructions()}
        else:
            out.insert(0, {"role": "system", "content": tools.instructions()})
    return out


def parse_calls(tools: Tools, text: str) -> tuple[list[tuple[str, str]], str | None]:
    """The model's text -> ([(function name, arguments as JSON text)], the content left); no calls when it
    does not parse (e.g. cut by max_tokens)."""
    if tools.choice not in ("auto", "required"):
        return [(tools.choice, text)], None
    if tools.choice == "required":
        try:
            return [(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)], None
        except (json.JSONDecodeError, KeyError, TypeError):
            return [], text
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return [], text
        if name not in tools.functions:
            return [], text
        calls.append((name, args if isinstance(args, str) else json.dumps(args)))
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return calls, content or None


@dataclass
class ToolCallStream:
    """One choice's stream of a tool-calling request: deltas as OpenAI streams them. A named function's
    arguments stream as they are generated; `required` and `auto` calls come whole once they end (auto streams
    plain content as usual, and holds back only text that may open a <tool_call>)."""

    tools: Tools
    id_prefix: str
    """Call i's id is id_prefix + str(i)."""
    held: str = ""
    is_content: bool = False
    sent: bool = False
    _calls: list = field(default_factory=list)

    def delta(self, text: str) -> dict:
        if self.tools.choice not in ("auto", "required"):
            if self.sent:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            self.sent = True
            return {"tool_calls": [{"index": 0, "id": self.id_prefix + "0", "type": "function",
                                    "function": {"name": self.tools.choice, "arguments": text}}]}
        if self.is_content:
            return {"content": text} if text else {}
        self.held += text
        start = self.held.lstrip()
        if self.tools.choice == "auto" and not (TOOL_TAG.startswith(start) or start.startswith(TOOL_TAG)):
            self.is_content, text, self.held = True, self.held, ""
            return {"content": text}
        return {}

    def finish(self, reason: str | None) -> tuple[dict, str | None]:
        """The last delta and the finish_reason: tool_calls when the calls came whole."""
        if reason is None:
            return {}, None
        if self.tools.choice not in ("auto", "required"):
            return {}, "tool_calls" if reason == "stop" else reason
        if self.is_content or not self.held:
            return {}, reason
        calls, content = parse_calls(self.tools, self.held)
        if not calls:
            return {"content": self.held}, reason
        delta = {"tool_calls": tool_calls(calls, self.id_prefix)}
        return ({**delta, "content": content} if content else delta), "tool_calls" if reason == "stop" else reason


def tool_calls(calls: list[tuple[str, str]], id_prefix: str) -> list[dict]:
    """OpenAI's tool_calls entries; call i's id is id_prefix + str(i)."""
    return [{"index": i, "id": f"{id_prefix}{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(calls)]


def tool_message(tools: Tools, text: str, reason: str, id_prefix: str) -> tuple[dict, str]:
    """A whole response's message and finish_reason for the model's `text`."""
    calls, content = parse_calls(tools, text)
    if not calls or (reason != "stop" and tools.choice in ("auto", "required")):
        return {"role": "assistant", "content": text}, reason
    entries = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls(calls, id_prefix)]
    return {"role": "assistant", "content": content, "tool_calls": entries}, "tool_calls" if reason == "stop" else reason
