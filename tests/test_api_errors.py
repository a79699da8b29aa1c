"""Bad requests get OpenAI-shaped errors with the right status; the server keeps serving."""
import httpx
import pytest

CASES = [
    ("/v1/completions", b"{not json", 422),
    ("/v1/completions", {"max_tokens": 4}, 422),  # missing prompt
    ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}, 422),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": [10**7]}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 422),
]


@pytest.mark.parametrize("path,body,status", CASES)
def test_bad_request_gets_openai_error(server, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_prompt_longer_than_context_is_400(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 9000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_server_still_serves_after_bad_requests(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
