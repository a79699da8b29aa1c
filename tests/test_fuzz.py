"""Fuzzed request bodies against the real server: never a 5xx, always OpenAI's error shape, and
the server still serves with every KV block back afterwards."""
from __future__ import annotations

import json
import time

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

KNOWN = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "seed", "stop", "stream", "stream_options", "ignore_eos", "user", "n", "presence_penalty",
         "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "role", "content"]
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-3, 40) | st.floats()
           | st.text(max_size=24) | st.sampled_from(["user", "assistant", "text", "\ud800", "<|im_end|>"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(KNOWN) | st.text(max_size=6), inner, max_size=4), max_leaves=12)
BASES = {"/v1/completions": {"prompt": "Hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}}


@st.composite
def requests(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "any_json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "any_json":
        return path, json.dumps(draw(JSON)).encode()
    body = dict(BASES[path])
    for key in draw(st.sets(st.sampled_from(sorted(body)), max_size=1)):
        del body[key]
    body.update(draw(st.dictionaries(st.sampled_from(KNOWN) | st.text(max_size=8), JSON, max_size=3)))
    return path, json.dumps(body).encode("utf-8", "surrogatepass")


CLIENT = httpx.Client(timeout=3)  # one keep-alive client: making one per request costs more than the request


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(req=requests())
def test_fuzzed_bodies_never_5xx(server, req):
    path, content = req
    try:
        # a valid body may ask for many tokens: leave after 3 s (the server aborts it)
        with CLIENT.stream("POST", server.url + path, content=content,
                           headers={"content-type": "application/json"}) as r:
            assert r.status_code < 500, (r.status_code, r.read())
            if r.status_code >= 400:
                err = json.loads(r.read())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
            else:
                for line in r.iter_lines():
                    assert '"type": "server_error"' not in line, line
    except httpx.ReadTimeout:
        pass


def test_server_serves_after_fuzzing(server):
    deadline = time.monotonic() + 15
    while server.engine.blocks.used_bytes or server.engine.num_running or server.engine.num_waiting:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and httpx.get(server.url + "/health").json() == {"status": "ok"}
