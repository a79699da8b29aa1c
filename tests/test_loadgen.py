"""Load generator: trace readers (good and broken files), exact-length prompts, open-loop arrival
schedule, metrics on hand-made event logs, the client against a fake endpoint, and an end-to-end
replay of the Azure trace's first requests against a real hetserve server."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import threading

import numpy as np
import pytest

from loadgen.arrivals import LengthDist, clip_lengths, gamma_arrivals, rescale, synth_requests
from loadgen.client import Endpoint, RequestRecord, RequestSpec
from loadgen.compare import RunDirError, compare
from loadgen.fake_server import FakeServerState, serve
from loadgen.metrics import parse_slo, peak_concurrency, summarize
from loadgen.prompts import DEFAULT_TEXT, PromptBuilder, TargetTokenizer
from loadgen.report import write_report
from loadgen.runner import RunResult, run_requests, served_model
from loadgen.traces import (
    TraceFilter,
    TraceFormatError,
    apply_filter,
    parse_azure_time,
    read_azure,
    read_burstgpt,
    read_trace,
)
from hetserve.cli import main as hetserve_main
from tests.conftest import SHARED, free_port

AZURE = SHARED / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"


def write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------- traces

def test_azure_good_file(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                  "2023-11-16 18:15:46.6805900,374,44\n"
                                  "2023-11-16 18:15:50.9951690,396,109\n"
                                  "2023-11-16 18:15:46.1805900,10,1\n")  # out of order: sorted
    tr = read_azure(p)
    assert tr.bad_rows == ()
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.line) for r in tr.requests] == [(10, 1, 4), (374, 44, 2),
                                                                                          (396, 109, 3)]
    assert [r.arrival_s for r in tr.requests] == pytest.approx([0.0, 0.5, 4.814579], abs=1e-5)
    # the 2024 release writes a zone: same instant as the naive (UTC) form
    assert parse_azure_time("2024-05-10 00:00:00.009930+00:00") == parse_azure_time("2024-05-10 00:00:00.00993")


def test_azure_broken_rows_are_reported_with_line(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                  "2023-11-16 18:15:46.68,374,44\n"
                                  "yesterday,1,2\n"
                                  "2023-11-16 18:15:47,abc,2\n"
                                  "2023-11-16 18:15:48,5\n"
                                  "\n"
                                  "2023-11-16 18:15:49,-3,2\n"
                                  "2023-11-16 18:15:50,7,0\n"
                                  "2023-11-16 18:15:51,7,3\n")
    tr = read_azure(p)
    assert [r.line for r in tr.requests] == [2, 9]
    assert [b.line for b in tr.bad_rows] == [3, 4, 5, 7, 8]
    text = [str(b) for b in tr.bad_rows]
    assert text[0].startswith(f"{p}:3: TIMESTAMP 'yesterday'") and "ContextTokens" in text[1]
    assert "2 fields" in text[2] and "non-negative" in text[3] and "0 output" in text[4]


@pytest.mark.parametrize("content,match", [("", "empty file"), ("time,a,b\n1,2,3\n", "header lacks TIMESTAMP")])
def test_azure_unreadable_file_raises(tmp_path, content, match):
    with pytest.raises(TraceFormatError, match=match):
        read_azure(write(tmp_path, "bad.csv", content))
    with pytest.raises(TraceFormatError, match="no such trace file"):
        read_trace(tmp_path / "missing.csv", "azure")


def test_real_azure_trace_reads_clean():
    tr = read_azure(AZURE)
    assert len(tr.requests) == 19366 and tr.bad_rows == ()
    first = tr.requests[0]
    assert (first.arrival_s, first.num_prompt_tokens, first.num_output_tokens) == (0.0, 374, 44)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(tr.requests, tr.requests[1:]))


BURST_V1 = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "45,ChatGPT,1087,230,1317,Conversation log\n"
            "118,GPT-4,417,276,693,Conversation log\n"
            "185,ChatGPT,1360,647,2007,API log\n"
            "190,ChatGPT,0,0,0,Conversation log\n"
            "214.5,ChatGPT,185.0,215,400,API log\n"
            "nan,ChatGPT,1,2,3,API log\n")
BURST_V2 = ("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "10.0,s1,1.5,ChatGPT,100,20,120,Conversation log\n"
            "12.25,s1,2.0,GPT-4,50,10,60,Conversation log\n"
            "11.0,s2,0.5,ChatGPT,7,3,10,API log,extra\n")


def test_burstgpt_v1_layout_and_filters(tmp_path):
    tr = read_burstgpt(write(tmp_path, "b1.csv", BURST_V1))
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in tr.requests] == [
        (0, 472, 18), (40, 1087, 230), (113, 417, 276), (180, 1360, 647), (209.5, 185, 215)]
    assert [b.line for b in tr.bad_rows] == [6, 8] and "failed request" in tr.bad_rows[0].reason
    chat = apply_filter(tr.requests, TraceFilter(model="chatgpt"))
    assert [r.num_prompt_tokens for r in chat] == [472, 1087, 1360, 185] and chat[0].arrival_s == 0
    api = apply_filter(tr.requests, TraceFilter(log_type="API"))
    assert [r.arrival_s for r in api] == [0, 29.5]
    window = apply_filter(tr.requests, TraceFilter(start_s=40, end_s=180, max_requests=5))
    assert [r.num_prompt_tokens for r in window] == [1087, 417]
    assert len(apply_filter(tr.requests, TraceFilter(max_requests=2))) == 2
    with pytest.raises(ValueError):
        TraceFilter(start_s=5, end_s=1)


def test_burstgpt_session_layout(tmp_path):
    tr = read_burstgpt(write(tmp_path, "b2.csv", BURST_V2))
    got = [(r.arrival_s, r.session_id, r.model) for r in tr.requests]
    assert got == [(0.0, "s1", "ChatGPT"), (2.25, "s1", "GPT-4")]
    assert len(tr.bad_rows) == 1 and tr.bad_rows[0].line == 4 and "9 fields" in tr.bad_rows[0].reason


# ---------------------------------------------------------------- arrivals

def test_rescale_by_time_scale_and_rate():
    reqs = apply_filter(read_azure(AZURE).requests, TraceFilter(max_requests=11))
    fast = rescale(reqs, time_scale=0.1)
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s * 0.1 for r in reqs])
    at_5 = rescale(reqs, rate=5.0)
    assert at_5[-1].arrival_s == pytest.approx(10 / 5.0)  # 10 gaps at a mean 5 req/s
    ratio = [b.arrival_s / a.arrival_s for a, b in zip(reqs[1:], at_5[1:])]
    assert max(ratio) == pytest.approx(min(ratio))  # shape of the schedule kept
    assert all(r.arrival_s == 0 for r in rescale(reqs, rate=math.inf))
    with pytest.raises(ValueError):
        rescale(reqs, time_scale=0.5, rate=2.0)


def test_gamma_arrivals_rate_and_burstiness():
    poisson = np.diff(gamma_arrivals(20001, rate=50.0, burstiness=1.0, seed=1))
    bursty = np.diff(gamma_arrivals(20001, rate=50.0, burstiness=0.25, seed=1))
    assert poisson[1:].mean() == pytest.approx(1 / 50, rel=0.03)
    assert bursty[1:].mean() == pytest.approx(1 / 50, rel=0.05)
    cv = lambda g: g[1:].std() / g[1:].mean()
    assert cv(poisson) == pytest.approx(1.0, abs=0.05) and cv(bursty) == pytest.approx(2.0, abs=0.15)
    assert not gamma_arrivals(5, math.inf).any()


def test_synthetic_lengths():
    rng = np.random.default_rng(0)
    z = LengthDist("zipf", 16, 2048).sample(20000, rng)
    assert z.min() >= 16 and z.max() <= 2048 and np.median(z) < 400 < z.mean() * 2  # heavy tail, most short
    assert set(LengthDist("fixed", 5, 9).sample(10, rng)) == {9}
    u = LengthDist("uniform", 3, 5).sample(1000, rng)
    assert set(u) == {3, 4, 5}
    reqs = synth_requests(50, 10.0, 1.0, LengthDist("fixed", 8, 8), LengthDist("uniform", 1, 4), seed=3)
    assert len(reqs) == 50 and reqs[0].arrival_s == 0 and all(r.num_prompt_tokens == 8 for r in reqs)
    clipped = clip_lengths(reqs, 4, 2)
    assert all(r.num_prompt_tokens == 4 and r.num_output_tokens <= 2 for r in clipped)
    with pytest.raises(ValueError):
        LengthDist("zipf", 10, 5)


# ---------------------------------------------------------------- prompts

@pytest.fixture(scope="module")
def tok():
    return TargetTokenizer.load(None)


@pytest.fixture(scope="module")
def server_tokenizer():
    """The server's own tokenizer class (what it counts as usage.prompt_tokens)."""
    from gpu_model.loader import resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    return Tokenizer(resolve_model_dir(None), ())


LENGTHS = [1, 2, 3, 7, 31, 32, 64, 129, 500, 2049]


def test_exact_length_completion_prompts(tok, server_tokenizer):
    b = PromptBuilder(tok, DEFAULT_TEXT.read_text(), chat=False, seed=7)
    prompts = b.build_all(LENGTHS)
    assert [p.num_tokens for p in prompts] == LENGTHS
    assert [len(server_tokenizer.encode(p.text)) for p in prompts] == LENGTHS
    assert len({p.text[:50] for p in prompts[4:]}) == len(prompts[4:])  # different text per request
    assert b.build(64, 3) == b.build(64, 3)  # deterministic


def test_exact_length_chat_prompts_count_the_template(tok, server_tokenizer):
    b = PromptBuilder(tok, DEFAULT_TEXT.read_text(), chat=True)
    # SmolLM2's template adds a default system prompt: 30 tokens around one content token
    assert b.min_tokens == len(server_tokenizer.apply_chat_template([{"role": "user", "content": "the"}])) == 31
    for n in [31, 32, 33, 100, 777]:
        p = b.build(n, n)
        assert p.num_tokens == n
        assert len(server_tokenizer.apply_chat_template([{"role": "user", "content": p.text}])) == n
    short = b.build(5, 0)
    assert short.num_tokens == 31  # below the template's own length: raised to it, and reported


@pytest.mark.parametrize("chat", [False, True])
def test_shared_prefix_prompts_keep_exact_lengths(tok, server_tokenizer, chat):
    """Every prompt longer than the prefix starts with the same tokens (what a prefix cache matches), and every
    prompt still has exactly its length as the server counts it."""
    b = PromptBuilder(tok, DEFAULT_TEXT.read_text(), chat=chat, seed=3, shared_prefix_tokens=100)
    lengths = [40, 150, 300, 777]
    prompts = b.build_all(lengths)

    def ids(text: str) -> list[int]:
        return server_tokenizer.apply_chat_template([{"role": "user", "content": text}]) if chat else \
            server_tokenizer.encode(text)

    assert [p.num_tokens for p in prompts] == [len(ids(p.text)) for p in prompts] == lengths
    assert [p.text.startswith(b.prefix) for p in prompts] == [False, True, True, True]
    heads = {tuple(ids(p.text)[:100]) for p in prompts[1:]}
    assert len(heads) == 1 and len({p.text[len(b.prefix):][:50] for p in prompts[1:]}) == 3


# ---------------------------------------------------------------- metrics on hand-made logs

def rec(i, ttft, itl, n_out, ok=True, kind="", send=0.0, arrival=0.0) -> RequestRecord:
    e2e = ttft + sum(itl) if ok else 0.0
    return RequestRecord(i, arrival, send, ttft if ok else 0.0, tuple(itl), e2e, send + e2e + 0.001, 10, n_out,
                         n_out if ok else 0, 10, ok, kind, "boom" if kind else "")


def test_metrics_match_hand_computation():
    recs = (rec(0, 0.100, [0.02, 0.03, 0.01], 4),
            rec(1, 0.300, [0.05], 2, send=0.5),
            rec(2, 0.050, [], 1, send=1.0),
            rec(3, 0.0, [], 5, ok=False, kind="http_500", send=1.5),
            rec(4, 0.0, [], 5, ok=False, kind="timeout", send=1.6))
    s = summarize(RunResult(recs, 2.0, None), parse_slo("ttft_ms=200,tpot_ms=30"))
    assert (s["completed"], s["failed"], s["errors_by_kind"]) == (3, 2, {"http_500": 1, "timeout": 1})
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 7)
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(37 / 2)
    assert s["mean_ttft_ms"] == pytest.approx(150) and s["median_ttft_ms"] == pytest.approx(100)
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99))
    # TPOT = (e2e - ttft) / (n - 1): 60/3 = 20 ms and 50/1 = 50 ms; the one-token request has none
    assert s["mean_tpot_ms"] == pytest.approx(35) and s["p90_tpot_ms"] == pytest.approx(47)
    # ITL pools every gap of every request
    assert s["mean_itl_ms"] == pytest.approx(110 / 4) and s["median_itl_ms"] == pytest.approx(25)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 350 + 50) / 3)
    # goodput: request 0 (100 ms, 20 ms) and request 2 (50 ms, tpot 0) meet both SLOs; request 1's TTFT does not
    assert s["good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)
    assert s["output_lens"] == [4, 2, 1, 0, 0] and s["itls"][0] == [0.02, 0.03, 0.01]
    assert s["max_concurrent_requests"] == 1 and s["failed"] + s["completed"] == len(s["errors"])


def test_metrics_edge_cases():
    s = summarize(RunResult((rec(0, 0.0, [], 3, ok=False, kind="connection"),), 1.0, 4))
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0 and s["request_goodput"] is None
    assert s["max_concurrency"] == 4
    overlapping = (rec(0, 0.1, [0.5], 2, send=0.0), rec(1, 0.1, [0.5], 2, send=0.2), rec(2, 0.1, [], 1, send=0.9))
    assert peak_concurrency(overlapping) == 2
    assert parse_slo("ttft_ms=500, e2el=2000") == {"ttft": 500.0, "e2el": 2000.0}
    for bad in ("ttft=abc", "latency_ms=3", "tpot_ms=-1", "ttft_ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


# ---------------------------------------------------------------- client against a fake endpoint

@contextlib.contextmanager
def fake_endpoint(**kw):
    """loadgen.fake_server in a thread of its own (its own event loop)."""
    state, port, loop = FakeServerState(**kw), free_port(), asyncio.new_event_loop()
    started = threading.Event()

    async def main():
        srv = await serve(port, state)
        started.set()
        async with srv:
            with contextlib.suppress(asyncio.CancelledError):
                await srv.serve_forever()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    assert started.wait(10)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
        t.join(5)


def specs(arrivals, n_out=3):
    return [RequestSpec(i, a, "hello world", 2, n_out) for i, a in enumerate(arrivals)]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_client_counts_and_errors(api):
    with fake_endpoint(fail_every=3) as (url, _):
        res = asyncio.run(run_requests(specs([0.0] * 6, n_out=5), Endpoint(url, api, "fake"), show_progress=False))
    assert [r.is_success for r in res.records] == [True, True, False, True, True, False]
    assert {r.error_kind for r in res.records if not r.is_success} == {"http_500"}
    ok = [r for r in res.records if r.is_success]
    assert all(r.num_output_tokens == 5 and len(r.itl_s) == 4 and r.server_prompt_tokens == 2 for r in ok)
    assert all(0 < r.ttft_s <= r.e2e_s for r in ok)


def test_client_stream_errors_timeouts_and_missing_usage(tok):
    with fake_endpoint(stream_error_every=2, is_usage_supported=False) as (url, _):
        res = asyncio.run(run_requests(specs([0.0] * 2, n_out=4), Endpoint(url), show_progress=False,
                                       count_output=tok.count_output))
    first, second = res.records
    # no usage: output tokens counted by the tokenizer (" tok" x 4 is 4 tokens), prompt count unknown (-1)
    assert first.is_success and first.num_output_tokens == 4 and first.server_prompt_tokens == -1
    assert second.error_kind == "stream_error" and "injected" in second.error
    with fake_endpoint(ttft_s=2.0) as (url, _):
        res = asyncio.run(run_requests(specs([0.0]), Endpoint(url, timeout_s=0.3), show_progress=False))
    assert res.records[0].error_kind == "timeout"


def test_client_reports_connection_errors():
    res = asyncio.run(run_requests(specs([0.0, 0.0]), Endpoint(f"http://127.0.0.1:{free_port()}", timeout_s=5),
                                   show_progress=False))
    assert [r.error_kind for r in res.records] == ["connection", "connection"]


def test_open_loop_schedule_follows_timestamps():
    arrivals = [0.0, 0.05, 0.3, 0.31, 0.6]
    with fake_endpoint(ttft_s=0.2) as (url, _):  # each response takes longer than the gaps: still sent on time
        res = asyncio.run(run_requests(specs(arrivals), Endpoint(url), show_progress=False))
    lag = [r.send_at_s - r.arrival_s for r in res.records]
    assert all(-0.001 <= x < 0.05 for x in lag), lag
    assert peak_concurrency(res.records) >= 2


def test_concurrency_cap_holds_requests_in_the_client():
    with fake_endpoint(ttft_s=0.05) as (url, _):
        res = asyncio.run(run_requests(specs([0.0] * 4), Endpoint(url), max_concurrency=1, show_progress=False))
    r = sorted(res.records, key=lambda x: x.send_at_s)
    assert all(b.send_at_s >= a.done_at_s - 0.005 for a, b in itertools.pairwise(r))
    assert peak_concurrency(res.records) == 1 and res.max_concurrency == 1


def test_report_files_and_compare(tmp_path):
    dirs = []
    for name, ttft in (("fast", 0.0), ("slow", 0.03)):
        with fake_endpoint(ttft_s=ttft) as (url, _):
            res = asyncio.run(run_requests(specs([0.0, 0.01, 0.02]), Endpoint(url), show_progress=False))
        paths = write_report(tmp_path / name, summarize(res), res.records, {"name": name}, is_plotting=False)
        assert sorted(p.name for p in paths) == ["requests.csv", "summary.json"]
        dirs.append(tmp_path / name)
    assert json.loads((dirs[0] / "summary.json").read_text())["config"] == {"name": "fast"}
    table = compare(dirs, tmp_path / "cmp.png", tmp_path / "cmp.json")
    lines = table.splitlines()
    assert lines[1].startswith("fast") and lines[2].startswith("slow") and (tmp_path / "cmp.png").stat().st_size > 0
    numbers = json.loads((tmp_path / "cmp.json").read_text())
    assert numbers["slow"]["mean_ttft_ms"] >= 30 and numbers["fast"]["completed"] == 3
    with pytest.raises(RunDirError):
        compare([tmp_path], None)


def test_cli_synth_and_burstgpt_replay(tmp_path, tok, capsys):
    text = tmp_path / "text.txt"
    text.write_text(DEFAULT_TEXT.read_text()[:50_000])
    common = ["--text", str(text), "--no-progress", "--no-plots", "--max-output-tokens", "4"]
    with fake_endpoint(fail_every=7) as (url, _):
        code = hetserve_main(["loadgen", "synth", "--endpoint", url, "--api", "chat", "--num-requests", "7",
                              "--rate", "100", "--burstiness", "0.5", "--prompt-tokens", "40", "90",
                              "--output-dist", "fixed", "--output-tokens", "3", "3", "--out", str(tmp_path / "s"),
                              *common])
        assert code == 1  # a request failed
        s = json.loads((tmp_path / "s" / "summary.json").read_text())
        assert (s["completed"], s["failed"], s["errors_by_kind"]) == (6, 1, {"http_500": 1})
        assert s["burstiness"] == 0.5 and s["request_rate"] == 100 and s["output_lens"][:6] == [3] * 6
        assert all(40 <= n <= 90 for n in s["input_lens"]) and s["config"]["model"] == "fake"
        trace = write(tmp_path, "b.csv", BURST_V1)
        code = hetserve_main(["loadgen", "replay", str(trace), "--trace-format", "burstgpt", "--endpoint", url,
                              "--trace-model", "ChatGPT", "--time-scale", "0.001", "--out", str(tmp_path / "b"),
                              *common])
    assert code == 0
    err = capsys.readouterr().err
    assert f"skipped {trace}:6: " in err and f"skipped {trace}:8: " in err and "2 bad rows skipped" in err
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert s["input_lens"] == [472, 1087, 1360, 185] and s["output_lens"] == [4, 4, 4, 4]


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert hetserve_main(["loadgen", "replay", str(tmp_path / "none.csv"), "--trace-format", "azure",
                          "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "no such trace file" in capsys.readouterr().err
    assert hetserve_main(["loadgen", "compare", str(tmp_path)]) == 2


# ---------------------------------------------------------------- end to end against real hetserve

@pytest.mark.parametrize("api,num", [("completions", 10), ("chat", 3)])
def test_replay_azure_against_hetserve(server, tmp_path, api, num):
    out, text = tmp_path / "run", tmp_path / "text.txt"
    text.write_text(DEFAULT_TEXT.read_text()[:100_000])  # enough for 128-token prompts, quick to tokenize
    code = hetserve_main(["loadgen", "replay", str(AZURE), "--trace-format", "azure", "--endpoint", server.url,
                          "--api", api, "--max-requests", str(num), "--rate", "10", "--max-prompt-tokens", "128",
                          "--max-output-tokens", "8", "--text", str(text), "--out", str(out), "--no-progress",
                          "--slo", "ttft_ms=60000", "--shared-prefix-tokens", "64"])
    assert code == 0
    s = json.loads((out / "summary.json").read_text())
    trace = apply_filter(read_azure(AZURE).requests, TraceFilter(max_requests=num))
    want_in = [max(min(r.num_prompt_tokens, 128), 31 if api == "chat" else 1) for r in trace]
    want_out = [min(r.num_output_tokens, 8) for r in trace]
    assert (s["completed"], s["failed"], s["errors_by_kind"]) == (num, 0, {})
    assert s["input_lens"] == want_in and s["output_lens"] == want_out
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (sum(want_in), sum(want_out))
    assert s["num_prompt_len_mismatch"] == 0 and s["num_output_len_mismatch"] == 0  # the server counted the same
    assert 0 < s["prompt_cached_share"] < 1  # the shared prefix's blocks, from hetserve's prefix cache
    assert s["good_requests"] == num and 0 < s["mean_ttft_ms"] < s["mean_e2el_ms"] and s["mean_tpot_ms"] > 0
    assert asyncio.run(served_model(server.url)) == (server.model_name, 8192)  # for the context warning
    rows = (out / "requests.csv").read_text().splitlines()
    assert len(rows) == num + 1 and (out / "timeline.png").is_file() and (out / "latency_cdf.png").is_file()
