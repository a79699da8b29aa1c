"""End to end through real HTTP and the real model: equality with HF transformers, the openai
client, concurrency, seeds and KV accounting."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "List five tips for learning a new programming language, with a sentence on each.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle step by step.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in detail.",
    "Write a haiku about autumn, then explain its imagery.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a good cup of coffee at home?",
]
NEW_TOKENS = 40


def chat(url: str, prompt: str, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": NEW_TOKENS, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def hf_model(server):
    """HF transformers' tokenizer and model on the same dequantized GGUF weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = server.engine.backend.model_dir
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # compare with ignore_eos: run past <|im_end|>
    return AutoTokenizer.from_pretrained(model_dir), hf


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """Greedy continuations from HF transformers' generate."""
    tok, hf = hf_model
    refs = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        refs.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return refs


def test_greedy_equals_hf_generate_one_at_a_time(server, hf_reference):
    for prompt, ref in zip(PROMPTS, hf_reference):
        out = chat(server.url, prompt, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == NEW_TOKENS
        assert out["choices"][0]["message"]["content"] == ref


def test_greedy_equals_hf_generate_concurrently(server, hf_reference):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: chat(server.url, p, ignore_eos=True), PROMPTS))
    assert [o["choices"][0]["message"]["content"] for o in outs] == hf_reference


def test_openai_client_both_endpoints_streaming_and_not(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [server.model_name]
    msgs = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=16, temperature=0)
    streamed = client.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    comp = client.completions.create(model=server.model_name, prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    comp_stream = client.completions.create(model=server.model_name, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in comp_stream) == comp.choices[0].text
    assert comp.usage.completion_tokens == 8 and comp.choices[0].finish_reason == "length"


def stream_text(client: httpx.Client, url: str, body: dict) -> str:
    text = []
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.mark.slow  # the default run's 100-stream test in test_reliability.py checks the same property, lighter
def test_32_concurrent_streams_equal_each_request_alone(server):
    bodies = [{"prompt": f"Story number {i}: once upon a time, in a land of {w},", "max_tokens": 24 + i % 9,
               "temperature": 0} for i, w in enumerate(["ice", "fire", "sand", "glass"] * 8)]
    with httpx.Client() as client:
        alone = [stream_text(client, server.url, b) for b in bodies]
        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda b: stream_text(client, server.url, b), bodies))
    assert together == alone
    assert server.engine.blocks.used_bytes == 0


def test_seeded_sampling_is_reproducible(server):
    body = {"prompt": "My favourite animal is", "max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "top_k": 50,
            "seed": 1234}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    other = httpx.post(server.url + "/v1/completions", json={**body, "seed": 99}, timeout=60).json()
    assert first == second
    assert other["choices"][0]["text"] != first


def test_stop_string_and_natural_eos(server):
    out = httpx.post(server.url + "/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 20,
                                                            "temperature": 0, "stop": [" 7"]}, timeout=60).json()
    assert out["choices"][0]["finish_reason"] == "stop" and " 7" not in out["choices"][0]["text"]
    reply = chat(server.url, "Say just the word yes.", max_tokens=64)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] < 64


def test_logprobs_equal_hf_log_softmax(server, hf_model):
    """Completions' logprobs (the sampled token's and the top 3) against HF's log-softmax over the same tokens;
    chat's logprobs through the openai client, whole and streamed, with bytes that rebuild the text."""
    import openai

    tok, hf = hf_model
    prompt, n = "The capital of France is", 8
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 3}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = out["logprobs"]
    assert "".join(lp["tokens"]) == out["text"] and len(lp["tokens"]) == n
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    ids = server.engine.tokenizer.encode(prompt)
    gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(gen[None]).logits[0, len(ids) - 1 : -1].float(), -1)
    for i, t in enumerate(gen[len(ids):].tolist()):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i, t].item(), abs=1e-3)
        top = ref[i].topk(3)
        want = {tok.decode([j]): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=1e-3)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(lp["token_logprobs"][i])  # greedy: the best
    none = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert none["choices"][0]["logprobs"] is None

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kw = {"model": server.model_name, "messages": [{"role": "user", "content": "Say café in Japanese."}],
          "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert bytes(b for c in content for b in c.bytes).decode() == whole.message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    streamed = [c for ch in chunks for c in ch.choices[0].logprobs.content]
    # the same prompt again: its cached blocks are not recomputed, which moves the logprobs in the last digits
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


def test_penalties_equal_a_penalized_hf_greedy_loop(server, hf_model):
    """presence and frequency penalties, greedy: token for token what HF's logits give with OpenAI's penalty
    subtracted (counts of the tokens sampled so far), and not the unpenalized text."""
    _, hf = hf_model
    prompt, n, presence, frequency = "Repeat after me: la la la la la la la", 24, 0.4, 0.8
    ids = server.engine.tokenizer.encode(prompt)
    with torch.no_grad():
        out, step = [], hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = step.logits[0, -1].float()
            for t in set(out):
                logits[t] -= presence + frequency * out.count(t)
            out.append(int(logits.argmax()))
            cache = {"cache": step.cache} if "cache" in step else {"past_key_values": step.past_key_values}
            step = hf(torch.tensor([out[-1:]]), use_cache=True, **cache)  # transformers renamed the argument
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    got = httpx.post(server.url + "/v1/completions", json={**body, "presence_penalty": presence,
                                                             "frequency_penalty": frequency}, timeout=60).json()
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == server.engine.tokenizer.decode(out)
    assert plain["choices"][0]["text"] != got["choices"][0]["text"]


def test_n_choices_whole_and_streamed(server):
    """n choices: choice i samples from seed + i (so choice 0 is the n = 1 request), usage counts the prompt once;
    a stream interleaves the choices by index; greedy choices are all the same."""
    body = {"prompt": "My favourite animal is", "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    out = httpx.post(server.url + "/v1/completions", json={**body, "n": 3, "logprobs": 1}, timeout=60).json()
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    for c in out["choices"]:  # each choice's offsets start at 0 (special tokens are listed, though text skips them)
        assert len(c["logprobs"]["tokens"]) == 12 and c["logprobs"]["text_offset"][0] == 0
    one = [httpx.post(server.url + "/v1/completions", json={**body, "seed": 7 + i}, timeout=60).json() for i in range(3)]
    assert texts == [o["choices"][0]["text"] for o in one]
    assert out["usage"]["prompt_tokens"] == one[0]["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 36
    streamed = ["", "", ""]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "n": 3, "stream": True,
                                                                     "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for ev in events[:-1]:
        streamed[ev["choices"][0]["index"]] += ev["choices"][0]["text"]
    assert streamed == texts and events[-1]["usage"]["completion_tokens"] == 36
    greedy = chat(server.url, "Say hello.", n=2, max_tokens=8)["choices"]
    assert len(greedy) == 2 and greedy[0]["message"] == greedy[1]["message"]
    assert server.engine.blocks.used_bytes == 0
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "n": 3, "max_tokens": 500, "stream": True},
                      timeout=60) as r:
        next(r.iter_lines())  # a client that leaves after the first chunk: all three choices are aborted
    deadline = time.monotonic() + 5  # 1500 tokens would take far longer
    while server.engine.num_running + server.engine.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.num_running + server.engine.num_waiting == 0 and server.engine.blocks.used_bytes == 0


def test_echo_scores_the_prompt_like_hf(server, hf_model):
    """echo with logprobs: each prompt token's logprob after the ones before it (the first has none), over a
    prompt that prefills in two chunks (max_num_batched_tokens 512), against HF's log-softmax; max_tokens 0
    scores alone; a prompt of token ids in a one-element batch (lm-eval-harness' form) is taken."""
    _, hf = hf_model
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ids = server.engine.tokenizer.encode(text)
    assert 512 < len(ids) < 1024
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
    out = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True,
                                                           "logprobs": 2}, timeout=120).json()
    choice = out["choices"][0]
    assert choice["text"] == text and out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                                       "total_tokens": len(ids),
                                                       "prompt_tokens_details": {"cached_tokens": 0}}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    short = ids[:20]
    both = httpx.post(server.url + "/v1/completions", json={"prompt": [short], "max_tokens": 3, "echo": True,
                                                            "logprobs": 0, "temperature": 0}, timeout=60).json()
    lp = both["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 23 and lp["token_logprobs"][1:20] == pytest.approx(want[:19], abs=1e-3)
    assert both["choices"][0]["text"].startswith(server.engine.tokenizer.decode(short))
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": short, "max_tokens": 3, "echo": True,
                                                             "temperature": 0}, timeout=60).json()["choices"][0]
    assert plain["text"] == both["choices"][0]["text"] and plain["logprobs"] is None
    for max_tokens in (0, 3):  # streamed: the prompt's text and logprobs in the first chunk
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": short, "max_tokens": max_tokens, "echo": True, "logprobs": 0,
                                "temperature": 0, "stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["text"] for c in chunks) == (both["choices"][0]["text"] if max_tokens else
                                                      server.engine.tokenizer.decode(short))
        scores = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert len(scores) == 20 + max_tokens and scores[1:20] == pytest.approx(want[:19], abs=1e-3)
    assert server.engine.blocks.used_bytes == 0


def test_logit_bias_bans_and_forces_tokens(server):
    """logit_bias -100 keeps a token out of a greedy continuation; +100 makes it every token."""
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 0}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    first = server.engine.tokenizer.encode(out["logprobs"]["tokens"][0])[-1]
    banned = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {str(first): -100}},
                        timeout=60).json()["choices"][0]
    assert banned["logprobs"]["tokens"][0] != out["logprobs"]["tokens"][0]
    forced = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {"28": 100}, "temperature": 1,
                                                                "seed": 3}, timeout=60).json()["choices"][0]
    token = server.engine.tokenizer.decode([28])
    assert forced["logprobs"]["tokens"] == [token] * 6 and forced["text"] == token * 6


def test_best_of_returns_the_candidates_with_the_best_mean_logprob(server):
    """best_of 4, n 2: the two of the four candidates (seeds seed + i) whose tokens' mean logprob is highest,
    best first, without logprobs unless asked; usage counts every candidate; no streaming of best_of > n."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    out = httpx.post(server.url + "/v1/completions", json={**body, "best_of": 4, "n": 2}, timeout=60).json()
    candidates = []
    for i in range(4):
        c = httpx.post(server.url + "/v1/completions", json={**body, "seed": 11 + i, "logprobs": 0},
                       timeout=60).json()["choices"][0]
        candidates.append((sum(c["logprobs"]["token_logprobs"]) / 8, c["text"]))
    assert [c["text"] for c in out["choices"]] == [t for _, t in sorted(candidates, reverse=True)[:2]]
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["choices"][0]["logprobs"] is None
    assert out["usage"]["completion_tokens"] == 32
    bad = httpx.post(server.url + "/v1/completions", json={**body, "best_of": 3, "stream": True}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"


def test_prefix_cache_reuses_a_prompts_blocks(server):
    """The same prompt again takes its full KV blocks from the prefix cache (usage says how many tokens) and
    gives the same greedy text, with logprobs within 1e-4; a longer prompt that starts with it (a conversation's
    next turn) takes them too; /metrics counts the hits, and idle cached blocks do not count as used."""
    ids = server.engine.tokenizer.encode(
        " ".join(f"Entry {i}: a heron waits by pond {i * 7} for the evening light." for i in range(30)))
    bs = server.engine.blocks.spec.block_size

    def complete(prompt: list[int]) -> dict:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": [prompt], "max_tokens": 8, "temperature": 0, "logprobs": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def hits() -> int:
        text = httpx.get(server.url + "/metrics").text
        return int(float(next(line.split()[1] for line in text.splitlines()  # prometheus_client writes 688.0
                              if line.startswith("hetserve:prefix_cache_hits_total "))))

    before = hits()
    cold, warm = complete(ids), complete(ids)
    cached = [out["usage"]["prompt_tokens_details"]["cached_tokens"] for out in (cold, warm)]
    assert cached == [0, (len(ids) - 1) // bs * bs] and cached[1] > 300
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        cold["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    longer = complete(ids + ids[:40])
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) // bs * bs
    assert hits() - before == cached[1] + len(ids) // bs * bs
    assert server.engine.blocks.used_bytes == 0


def test_oaken_prefix_cache_equals_a_prefill_chunked_at_the_same_place():
    """Oaken KV: a prompt whose first 400 tokens come from the prefix cache gives exactly what the same prompt
    prefilled cold in chunks of 400 (--max-num-batched-tokens) gives: either way its last rows read the first 400
    through the quantized store, and the cached blocks are the very ones the cold request wrote. (Against a prompt
    prefilled in one chunk, which attends to itself exactly, the cached one differs a little: measured, the sampled
    tokens' logprobs within 0.03-0.15 and the greedy text apart after 4-16 tokens.)"""
    from server.config import ServeConfig
    from tests.conftest import SHARED, RunningServer

    srv = RunningServer(ServeConfig(kv_format="oaken", kv_cache_bytes=256 * 2**20, max_num_seqs=8,
                                    max_num_batched_tokens=400, cpu_linear_dtype="float32"))
    try:
        ids = srv.engine.tokenizer.encode((SHARED / "data" / "wikitext-2" / "test.txt").read_text()[:3000])[:409]
        body = {"prompt": [ids], "max_tokens": 16, "temperature": 0, "logprobs": 0, "ignore_eos": True}
        cold, warm = (httpx.post(srv.url + "/v1/completions", json=body, timeout=300).json() for _ in range(2))
        assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (cold, warm)] == [0, 400]
        assert warm["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        assert srv.engine.blocks.used_bytes == 0
    finally:
        srv.close()
