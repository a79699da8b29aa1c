"""Structured outputs through the real server (real model, real HTTP): outputs parse and validate against
their JSON schema (fixed ones and schemas hypothesis draws), regexes, choices and grammars hold, with n,
best_of, seeds, logprobs, stop strings, streaming and preemption; bad schemas and grammars are 400s."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.config import ServeConfig
from tests.conftest import RunningServer

BYTES_PER_BLOCK_FP32 = 2 * 30 * 3 * 16 * 64 * 4  # SmolLM2-135M, block_size 16
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                       "maxItems": 3}},
    "required": ["name", "age", "color", "tags"], "additionalProperties": False}


def chat(url: str, schema: dict, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 200,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
            **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def complete(url: str, **kw) -> dict:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 64, "temperature": 0, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_with_n_seed_logprobs_and_cached_grammar(server):
    cached = server.engine.metrics.value("hetserve:grammar_compile_seconds_count", cached="true")
    out = chat(server.url, PERSON, n=3, temperature=0.8, seed=7, logprobs=True, top_logprobs=2)
    assert [c["finish_reason"] for c in out["choices"]] == ["stop"] * 3
    for c in out["choices"]:
        valid(c["message"]["content"], PERSON)
        tokens = "".join(t["token"] for t in c["logprobs"]["content"])
        assert tokens == c["message"]["content"] and all(t["logprob"] <= 0 for t in c["logprobs"]["content"])
    again = chat(server.url, PERSON, n=3, temperature=0.8, seed=7)
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in out["choices"]]
    assert server.engine.metrics.value("hetserve:grammar_compile_seconds_count", cached="true") > cached
    assert server.engine.metrics.value("hetserve:grammar_mask_seconds_count") > 0


def test_json_object_completions_guided_json_best_of_and_stream(server):
    out = complete(server.url, prompt="A JSON object describing a dog:", guided_json=json.dumps(PERSON), best_of=3,
                   n=1, temperature=1.0, seed=3, max_tokens=200)
    valid(out["choices"][0]["text"], PERSON)
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 200, "temperature": 0,
            "stream": True, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    text, reasons = "", []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                reasons.append(choice["finish_reason"])
    assert reasons[-1] == "stop"
    assert valid(text, PERSON) == valid(chat(server.url, PERSON)["choices"][0]["message"]["content"], PERSON)


def test_regex_choice_grammar_and_stop(server):
    out = complete(server.url, prompt="A phone number:", guided_regex=r"[0-9]{3}-[0-9]{4}", n=2, temperature=1.0,
                   seed=1)
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", c["text"]) for c in out["choices"])
    out = complete(server.url, prompt="Is the sky blue? Answer:", guided_choice=["yes", "no", "maybe"])
    assert out["choices"][0]["text"] in ("yes", "no", "maybe") and out["choices"][0]["finish_reason"] == "stop"
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    out = complete(server.url, prompt="Pick a number.", guided_grammar=gbnf)
    assert re.fullmatch(r"The answer is [0-9]{2}\.", out["choices"][0]["text"])
    out = complete(server.url, prompt="Pick a number.", guided_grammar=gbnf, stop=["is"])
    assert out["choices"][0]["text"] == "The answer " and out["choices"][0]["finish_reason"] == "stop"


def test_grammar_that_cannot_finish_in_max_tokens_ends_with_length(server):
    out = complete(server.url, prompt="Letters:", guided_regex="[a-z]{40,60}", max_tokens=4)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    assert "before the grammar was complete" in out["choices"][0]["stop_reason"]
    # streamed: the last chunk says it too
    with httpx.stream("POST", server.url + "/v1/completions", timeout=300,
                      json={"prompt": "Letters:", "guided_regex": "[a-z]{40,60}", "max_tokens": 4, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "before the grammar was complete" in chunks[-1]["choices"][0]["stop_reason"]
    # a length cut with the grammar complete, or without a grammar, says nothing more
    out = complete(server.url, prompt="Letters:", guided_regex="[a-z]{2,60}", max_tokens=4)
    assert out["choices"][0]["finish_reason"] == "length" and "stop_reason" not in out["choices"][0]


@pytest.mark.parametrize("extra, where", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "invalid JSON schema at /type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"if": {"const": 1}, "then": {"type": "string"}}}}}}},
     "unsupported JSON schema at /properties/a"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar: grammar does not compile"),
    ({"guided_regex": "a(b"}, "guided_regex: regex does not compile"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "not several"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_grammars_are_400_with_the_reason(server, extra, where):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert where in error["message"] and error["type"] == "invalid_request_error" and error["param"]


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["token_strs"] == ["Hello", " world"] and r["max_model_len"] > 0
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_ids["tokens"] == server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**7]}).status_code == 400


_LEAF = st.one_of(
    st.tuples(st.integers(-50, 50), st.integers(0, 500)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                                          "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "cat", "dog", "a b"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "string", "pattern": "^[a-z]{2,6}$"}),
)
_KEYS = st.sampled_from(["a", "id", "name", "tags", "size", "x_1"])


def _object(values):
    return st.dictionaries(_KEYS, values, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


SCHEMAS = _object(st.recursive(_LEAF, lambda inner: st.one_of(
    _object(inner), inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3})), max_leaves=4))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_drawn_schemas_always_validate(server, schema, seed):
    out = chat(server.url, schema, temperature=0.7, seed=seed, max_tokens=400)
    assert out["choices"][0]["finish_reason"] == "stop", out
    valid(out["choices"][0]["message"]["content"], schema)


@pytest.mark.slow  # a second server; the matchers live in the engine, which preemption does not touch
def test_preempted_constrained_requests_recompute_to_the_same_output(server):
    prompts = [f"Person number {i}, as JSON:" for i in range(6)]
    body = {"guided_json": PERSON, "max_tokens": 60, "temperature": 0}
    reference = [complete(server.url, prompt=p, **body)["choices"][0]["text"] for p in prompts]
    small = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=14 * BYTES_PER_BLOCK_FP32,
                                      cpu_linear_dtype="float32"))
    try:
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(lambda p: complete(small.url, prompt=p, **body)["choices"][0]["text"], prompts))
        assert small.engine.scheduler.num_preemptions > 0
        assert texts == reference
    finally:
        small.close()


@pytest.mark.slow  # starts a Ray cluster
def test_ray_executor_gives_the_local_constrained_outputs(server):
    pytest.importorskip("ray")
    ray = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, max_num_seqs=16, executor="ray",
                                    ray_cpu_actors=2, ray_microbatches=2, cpu_linear_dtype="float32"))
    try:
        prompts = [f"Person number {i}, as JSON:" for i in range(4)]
        body = {"guided_json": PERSON, "max_tokens": 60, "temperature": 0.7, "seed": 5}
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(ray.url, prompt=p, **body)["choices"][0]["text"], prompts))
        assert got == [complete(server.url, prompt=p, **body)["choices"][0]["text"] for p in prompts]
    finally:
        ray.close()
