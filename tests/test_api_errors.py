"""Bad requests get OpenAI-shaped errors with the right status and type; the server keeps serving."""
import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD, NOT_FOUND = "invalid_request_error", "not_found_error"
USER = [{"role": "user", "content": "hi"}]
CLIENT = httpx.Client(timeout=60)  # one keep-alive client: making one per request costs more than the request

# (method, path, body, status, error type, error param or None when not checked)
CASES = [
    ("POST", C, b"{not json", 400, BAD, None),  # the parser's reason and position in the message
    ("POST", C, b'{"prompt": "caf\xe9", "max_tokens": 1}', 400, BAD, None),  # Latin-1, not UTF-8
    ("POST", C, b'{"prompt": "\xff\xfe\xfa"}', 400, BAD, None),
    ("POST", C, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 422, BAD, None),  # lone surrogate escape
    ("POST", C, b"[1, 2, 3]", 422, BAD, None),  # JSON, but not an object
    ("POST", C, b"null", 422, BAD, None),
    ("POST", C, b"[" * 100_000 + b"]" * 100_000, 400, BAD, None),  # nesting beyond the JSON parser's depth
    ("POST", C, {"max_tokens": 4}, 422, BAD, "prompt"),  # missing prompt
    ("POST", C, {"prompt": "hi", "max_tokens": "four"}, 422, BAD, "max_tokens"),
    ("POST", C, {"prompt": "hi", "stream": "maybe"}, 422, BAD, "stream"),
    ("POST", C, {"prompt": {"text": "hi"}}, 422, BAD, None),
    ("POST", C, {"prompt": "", "max_tokens": 4}, 400, BAD, "prompt"),
    ("POST", C, {"prompt": [], "max_tokens": 4}, 400, BAD, "prompt"),
    ("POST", C, {"prompt": ["one", "two"]}, 400, BAD, "prompt"),  # batched prompts
    ("POST", C, {"prompt": [10**7]}, 400, BAD, "prompt"),  # token id beyond the vocabulary
    ("POST", C, {"prompt": [-1, 5]}, 400, BAD, "prompt"),
    ("POST", C, {"prompt": "word " * 9000, "max_tokens": 1}, 400, BAD, "prompt"),  # longer than the context
    ("POST", C, {"prompt": "hi", "max_tokens": 0}, 400, BAD, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": -3}, 400, BAD, "max_tokens"),
    ("POST", C, {"prompt": "hi", "max_tokens": 10**6}, 400, BAD, "max_tokens"),  # beyond the context
    ("POST", C, {"prompt": "hi", "temperature": 3}, 400, BAD, "temperature"),
    ("POST", C, {"prompt": "hi", "temperature": -0.5}, 400, BAD, "temperature"),
    ("POST", C, {"prompt": "hi", "top_p": 0}, 400, BAD, "top_p"),
    ("POST", C, {"prompt": "hi", "top_p": 1.5}, 400, BAD, "top_p"),
    ("POST", C, {"prompt": "hi", "top_k": -5}, 400, BAD, "top_k"),
    ("POST", C, {"prompt": "hi", "stop": [""]}, 400, BAD, "stop"),
    ("POST", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(9)]}, 400, BAD, "stop"),  # too many
    ("POST", C, {"prompt": "hi", "stop": "x" * 257}, 400, BAD, "stop"),  # too long
    ("POST", C, {"prompt": "hi", "n": 0}, 400, BAD, "n"),
    ("POST", C, {"prompt": "hi", "n": 17}, 400, BAD, "n"),
    ("POST", C, {"prompt": "hi", "best_of": 2, "n": 3}, 400, BAD, "best_of"),  # fewer candidates than choices
    ("POST", C, {"prompt": "hi", "suffix": "!"}, 400, BAD, "suffix"),  # known but unsupported
    ("POST", C, {"prompt": "hi", "logprobs": 21}, 400, BAD, "logprobs"),
    ("POST", C, {"prompt": "hi", "logprobs": -1}, 400, BAD, "logprobs"),
    ("POST", C, {"prompt": "hi", "logprobs": "all"}, 422, BAD, "logprobs"),
    ("POST", C, {"prompt": [[1, 2], [3, 4]]}, 400, BAD, "prompt"),  # batched token prompts
    ("POST", C, {"prompt": "hi", "max_tokens": 0}, 400, BAD, "max_tokens"),  # 0 only with echo
    ("POST", C, {"prompt": "hi", "presence_penalty": 2.5}, 400, BAD, "presence_penalty"),
    ("POST", C, {"prompt": "hi", "frequency_penalty": -3}, 400, BAD, "frequency_penalty"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"5": 101.0}}, 400, BAD, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"the": 1.0}}, 400, BAD, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"\u00b2": 1.0}}, 400, BAD, "logit_bias"),  # a digit, not ASCII
    ("POST", C, {"prompt": "hi", "logit_bias": {str(10**7): 1.0}}, 400, BAD, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(301)}}, 400, BAD, "logit_bias"),
    ("POST", C, {"prompt": "hi", "logit_bias": {"5": "up"}}, 422, BAD, "logit_bias.5"),
    ("POST", C, {"prompt": "hi", "frobnicate": True}, 400, BAD, "frobnicate"),  # unknown parameter
    ("POST", C, {"prompt": "hi", "model": "gpt-9"}, 404, NOT_FOUND, "model"),
    ("POST", C, {"prompt": "x" * (3 * 2**20)}, 413, BAD, None),  # body over max_body_bytes
    ("POST", CHAT, {"messages": []}, 400, BAD, "messages"),
    ("POST", CHAT, {"max_tokens": 4}, 422, BAD, "messages"),
    ("POST", CHAT, {"messages": "hi"}, 422, BAD, "messages"),
    ("POST", CHAT, {"messages": [{"content": "hi"}]}, 422, BAD, "messages.0.role"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, BAD, "messages[0].role"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, BAD, "messages[0].content"),
    ("POST", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, BAD, "max_completion_tokens"),
    ("POST", CHAT, {"messages": USER, "max_tokens": 4, "max_completion_tokens": 5}, 400, BAD, "max_completion_tokens"),
    ("POST", CHAT, {"messages": USER, "top_logprobs": 3}, 400, BAD, "top_logprobs"),  # without logprobs: true
    ("POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, BAD, "top_logprobs"),
    ("POST", CHAT, {"messages": USER, "model": "gpt-9"}, 404, NOT_FOUND, "model"),
    ("POST", "/v1/embeddings", {"input": "hi"}, 404, NOT_FOUND, None),  # no such route
    ("GET", C, None, 405, BAD, None),
]


@pytest.mark.parametrize("method,path,body,status,err_type,param", CASES,
                         ids=[f"{i:02d}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_request_gets_openai_error(server, method, path, body, status, err_type, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = CLIENT.request(method, server.url + path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == err_type, err
    if param is not None:
        assert err["param"] == param, err
    assert r.headers["x-request-id"]


def test_prompt_longer_than_context_is_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 9000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_server_still_serves_after_bad_requests(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.engine.blocks.used_bytes == 0


def test_malformed_json_says_where(server):
    r = CLIENT.post(server.url + C, content=b'{"prompt": "hi",, "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "json_invalid" and err["param"] is None, r.text
    assert err["message"].startswith("request body is not valid JSON: ") and "(at character 16)" in err["message"], err
