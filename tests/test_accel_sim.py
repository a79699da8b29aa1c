"""accel_sim: cost model on hand-computed cases, capacity/OOM edges, determinism, trace reading,
the validation rows that are cheap, and the sim backend answering through the real HTTP server."""
from __future__ import annotations

import dataclasses
import json
import math

import httpx
import pytest
import yaml

from accel_sim.cost import StepWork, step_cost
from accel_sim.hardware import DATA_DIR, LayeredKV, System, load_device, load_formats, make_system
from accel_sim.models import MODELS, get_model
from accel_sim.sim import Request, SchedulerLimits, simulate
from accel_sim.workloads import AZURE_CONV_TRACE, fixed_batch, read_trace

# A device with round numbers: 1 TB/s, 1 PFLOPS, perfect efficiency, no overhead.
UNIT = dataclasses.replace(load_device("oaken-lpddr"), mem_bytes=100e9, mem_bw_bytes_s=1e12, peak_tflops=1000,
                           vector_tflops=1000, eta_mem=1.0, eta_compute=1.0, eta_vector=1.0, step_overhead_s=0.0,
                           usable_mem_fraction=1.0, link_bw_bytes_s=1e12, link_latency_s=0.0)


def unit_system(model="llama2-7b", fmt="fp16", num_devices=1, **device) -> System:
    return System("unit", dataclasses.replace(UNIT, **device), load_formats()[fmt], get_model(model), num_devices)


# ---- models and data files

def test_parameter_counts_match_published_totals():
    published = {"llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama2-70b": 69.0e9, "opt-1.3b": 1.3e9,
                 "opt-30b": 30.0e9, "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9, "smollm2-135m": 0.135e9}
    for name, total in published.items():
        assert MODELS[name].total_params == pytest.approx(total, rel=0.02), name
    # Llama2-7B by hand: 32 x (4*4096^2 + 3*4096*11008) + 2 * 32000*4096
    assert MODELS["llama2-7b"].total_params == 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 2 * 32000 * 4096


def test_every_device_number_has_a_source():
    for path in sorted((DATA_DIR / "devices").glob("*.yaml")) + [DATA_DIR / "kv_formats.yaml"]:
        raw = yaml.safe_load(path.read_text())
        entries = raw.values() if path.name != "kv_formats.yaml" else [v for f in raw.values() for v in f.values()]
        numbers = [e for e in entries if isinstance(e, dict)]
        assert numbers, path
        for e in numbers:
            assert set(e) == {"value", "source"} and str(e["source"]).strip(), (path, e)


def test_oaken_bits_are_the_measured_ones():
    assert load_formats()["oaken"].bits_per_value == 5.49  # hetserve eval at group ratios 0.06 / 0.08 (kv_formats.yaml)
    sys_ = make_system("oaken-lpddr", get_model("llama2-13b"))
    assert sys_.kv_bytes_per_token == pytest.approx(2 * 40 * 5120 * 5.49 / 8)


def test_kivi_residual_and_qserve_bits():
    m = get_model("llama2-7b")
    kivi, qserve = make_system("a100-kivi", m, 1), make_system("a100-qserve", m, 1)
    values = 2 * 32 * 4096
    # 1000 tokens: 128 newest in fp16, the rest at 4 bits + fp16 scale/zero per 32 values
    assert kivi.seq_kv_bytes(1000) == pytest.approx(872 * values * 5 / 8 + 128 * values * 2)
    assert qserve.seq_kv_bytes(1000) == pytest.approx(1000 * values * 4.25 / 8)


# ---- cost model, hand-computed

def test_decode_step_is_weights_plus_kv_over_bandwidth():
    sys_ = unit_system()
    w = StepWork(num_decode=1, decode_kv_tokens=1000, num_sampled=1)
    weights = (32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096) * 2  # layers + LM head, fp16
    kv = (1000 + 1) * 2 * 32 * 4096 * 2  # read 1000 tokens, write 1
    cost = step_cost(sys_, w)
    assert cost.linear_s == pytest.approx(weights / 1e12)
    assert cost.attention_s == pytest.approx(kv / 1e12)
    assert cost.time_s == pytest.approx((weights + kv) / 1e12)


def test_prefill_is_compute_bound_with_causal_attention_flops():
    sys_ = unit_system()
    m = sys_.model
    w = StepWork(prefill_tokens=2048, prefill_attn_pairs=2048 * 2049 / 2, num_sampled=1)
    lin_flops = 2 * (m.active_layer_params * 2048 + m.head_params)
    attn_flops = 4 * 32 * 32 * 128 * 2048 * 2049 / 2
    cost = step_cost(sys_, w)
    assert cost.linear_s == pytest.approx(lin_flops / 1e15)  # 27 ms of flops vs 13 ms of weights
    assert cost.attention_s == pytest.approx(attn_flops / 1e15)


def test_dequantization_costs_vector_time_only_where_not_hidden():
    w = StepWork(num_decode=64, decode_kv_tokens=64 * 4096, num_sampled=64)
    values = 64 * 4096 * 2 * 32 * 4096
    slow_vector = dict(vector_tflops=2.0)  # 1e12 FMA/s: attention is instruction-bound
    gpu = step_cost(unit_system(fmt="kivi4", kv_dequant_hidden=False, **slow_vector), w)
    oaken = step_cost(unit_system(fmt="kivi4", kv_dequant_hidden=True, **slow_vector), w)
    assert gpu.attention_s == pytest.approx(values * (1 + 3) / 1e12)  # 1 FMA (MHA) + 3 dequant instr
    assert oaken.attention_s == pytest.approx(values * 1 / 1e12)


def test_pipeline_reads_weights_once_and_splits_kv():
    w = StepWork(num_decode=256, decode_kv_tokens=256 * 1024, num_sampled=256)
    one, two = step_cost(unit_system(), w), step_cost(unit_system(num_devices=2), w)
    assert two.linear_s == pytest.approx(one.linear_s)  # each stage reads its half once per micro-batch
    assert two.attention_s == pytest.approx(one.attention_s / 2)
    assert two.link_s == pytest.approx(2 * 128 * 4096 * 2 / 1e12)


def test_moe_reads_only_experts_in_use():
    m = get_model("mixtral-8x7b")
    dense = m.num_layers * (m.attn_params_per_layer + m.hidden_size * 8)
    assert m.layer_params_touched(1) == pytest.approx(dense + 32 * 2 * m.expert_params)
    assert m.layer_params_touched(10_000) == pytest.approx(m.layer_params)


# ---- capacity and OOM edges

def test_fits_batch_boundary_is_exact():
    sys_ = unit_system()  # 100 GB, 13.5 GB of weights
    per_seq = 1000 * 2 * 32 * 4096 * 2
    n = int(sys_.kv_capacity_bytes // per_seq)
    assert sys_.fits_batch(n, 1000) and not sys_.fits_batch(n + 1, 1000)


def test_paper_oom_edges():
    m = get_model("llama2-13b")
    hbm, lpddr = make_system("oaken-hbm", m, 1), make_system("oaken-lpddr", m, 1)
    assert hbm.fits_batch(16, 8192) and not hbm.fits_batch(16, 16384)
    assert lpddr.fits_batch(16, 32768)


def test_request_that_never_fits_is_rejected_and_others_finish():
    sys_ = make_system("a100-vllm", get_model("llama2-13b"), 1)
    too_long = sys_.kv_capacity_tokens
    reqs = [Request(0, 0.0, too_long, 10), Request(1, 0.0, 100, 10)]
    res = simulate([sys_], reqs)
    assert reqs[0].rejected and math.isnan(reqs[0].finish_s)
    assert not reqs[1].rejected and reqs[1].finish_s > 0


def test_memory_pressure_preempts_and_still_finishes_everything():
    sys_ = make_system("a100-vllm", get_model("llama2-13b"), 1)  # ~56k tokens of fp16 KV
    reqs = fixed_batch(64, 512, 1024)  # 64 x 1.5k = 98k tokens at the end: cannot all stay
    res = simulate([sys_], reqs, SchedulerLimits(max_num_seqs=64))
    s = res.summary()
    assert s["num_finished"] == 64 and s["num_preemptions"] > 0
    assert all(r.finish_s > r.first_token_s > 0 for r in reqs)
    assert res.replicas[0].num_generated == 64 * 1024  # preempted sequences resume, not restart or overrun


def test_step_count_is_exact_for_one_request():
    sys_ = unit_system()
    res = simulate([sys_], [Request(0, 0.0, 8, 3)], SchedulerLimits(max_num_seqs=1))
    # one prefill step (samples token 1), then two decode steps at lengths 9 and 10
    steps = [StepWork(prefill_tokens=8, prefill_attn_pairs=36, num_sampled=1),
             StepWork(num_decode=1, decode_kv_tokens=9, num_sampled=1),
             StepWork(num_decode=1, decode_kv_tokens=10, num_sampled=1)]
    expected = sum(step_cost(sys_, w).time_s for w in steps)
    r = res.requests[0]
    assert r.first_token_s == pytest.approx(step_cost(sys_, steps[0]).time_s)
    assert r.finish_s == pytest.approx(expected)


# ---- layered KV sparsity

def decoding_kept_tokens(rep) -> float:
    """The decoding sequences' KV, counted one sequence at a time: the full layers' share of each length plus
    the others' share of min(length, budget)."""
    f = rep.system.full_layer_share
    seqs = {id(s): s for fi, _, s in rep.heap if s.is_alive and s.finish_iter == fi}.values()
    return sum(f * (s.base + rep.iter) + (1 - f) * min(s.base + rep.iter, s.budget) for s in seqs)


@pytest.mark.parametrize("layered, preempts", [(LayeredKV(3, budget_tokens=700), True),
                                               (LayeredKV(1, budget_ratio=0.25), False)])
def test_layered_kv_counts_each_sequence_min_length_budget(layered, preempts, monkeypatch):
    """The replica's running sums equal a per-sequence count after every step, through admissions, budgets reached
    during decode (a fixed budget above some prompts), finishes and preemptions. A ratio budget is below every
    prompt, so those sequences hold it from their first decode and this load never preempts."""
    from accel_sim import sim

    sys_ = dataclasses.replace(make_system("a100-vllm", get_model("llama2-13b"), 1), layered=layered)
    checked = []
    finish = sim.Replica.finish_step

    def checked_finish(rep, now, finished):
        finish(rep, now, finished)
        assert rep.kept_tokens() == pytest.approx(decoding_kept_tokens(rep), abs=1e-6)
        checked.append(rep.num_decode)

    monkeypatch.setattr(sim.Replica, "finish_step", checked_finish)
    reqs = [Request(i, i * 0.02, 300 + 97 * (i % 13), 200 + 61 * (i % 9)) for i in range(400)]
    res = simulate([sys_], reqs, SchedulerLimits(max_num_seqs=128))
    s = res.summary()
    assert s["num_finished"] == 400 and (s["num_preemptions"] > 0) == preempts and max(checked) > 50


def test_layered_kv_runs_more_sequences_in_the_same_memory():
    """PPIO's shape on a memory-bound replica: 4,000-token prompts, 500 out, a quarter of the tokens kept in all
    but 3 of 40 layers: more sequences at once and more tokens a second than with every token kept."""
    full = make_system("a100-vllm", get_model("llama2-13b"), 1)
    layered = dataclasses.replace(full, layered=LayeredKV(3, budget_ratio=0.25))
    runs = [simulate([s], fixed_batch(64, 4000, 500), SchedulerLimits(max_num_seqs=64)).summary()
            for s in (full, layered)]
    assert runs[1]["max_concurrency"] >= 2 * runs[0]["max_concurrency"]
    assert runs[1]["gen_tok_s"] > 1.3 * runs[0]["gen_tok_s"]


def test_layered_kv_refuses_bad_settings():
    with pytest.raises(ValueError, match="one of budget_tokens and budget_ratio"):
        LayeredKV(3)
    with pytest.raises(ValueError, match="ratio in"):
        LayeredKV(3, budget_ratio=1.5)
    with pytest.raises(ValueError, match="has 40"):
        make_system("a100-vllm", get_model("llama2-13b"), 1, layered=LayeredKV(41, budget_tokens=100))


# ---- determinism and pools

def test_simulation_is_deterministic_with_a_seed():
    sys_ = make_system("oaken-lpddr", get_model("llama2-7b"))
    def run(seed):
        reqs = [Request(i, i * 0.05, 200 + 37 * (i % 11), 50 + 13 * (i % 7)) for i in range(300)]
        return simulate([sys_] * 3, reqs, routing="random", seed=seed).summary()
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_pool_of_two_replicas_serves_a_burst_faster():
    sys_ = make_system("a100-vllm", get_model("llama2-7b"))
    one = simulate([sys_], fixed_batch(64, 256, 128)).summary()
    two = simulate([sys_] * 2, fixed_batch(64, 256, 128)).summary()
    assert two["makespan_s"] < one["makespan_s"] and two["num_finished"] == 64


def test_mixed_pool_routes_to_every_replica():
    m = get_model("llama2-7b")
    pool = [make_system("oaken-lpddr", m), make_system("a100-vllm", m)]
    for routing in ("least-loaded", "round-robin", "random"):
        reqs = [Request(i, i * 0.01, 300, 40) for i in range(100)]
        simulate(pool, reqs, routing=routing)
        assert {r.replica for r in reqs} == {0, 1}, routing


# ---- traces

def test_burstgpt_layout_is_read(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n7.5,GPT-4,50,0,50,API log\n9,GPT-4,30,3,33,API log\n")
    reqs = read_trace(p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 100, 20), (4.0, 30, 3)]


@pytest.mark.skipif(not AZURE_CONV_TRACE.is_file(), reason="Azure trace not present")
def test_azure_trace_replays_in_timing_only_mode():
    reqs = read_trace(AZURE_CONV_TRACE, limit=500)
    assert (reqs[0].arrival_s, reqs[0].prompt_tokens, reqs[0].output_tokens) == (0.0, 374, 44)
    assert reqs[1].arrival_s == pytest.approx(4.3145788, abs=1e-6)
    s = simulate([make_system("oaken-lpddr", get_model("llama2-13b"))], reqs).summary()
    assert s["num_finished"] == 500 and s["gen_tok_s"] > 0


# ---- validation rows (the cheap ones; the full table is slow)

def test_validation_lpu_row_is_bandwidth_bound():
    from accel_sim.validate import lpu_ms_per_token

    ms = lpu_ms_per_token()
    weights_ms = get_model("opt-1.3b").total_params * 2 / (2.0e12 * 0.9) * 1e3
    assert weights_ms < ms < weights_ms * 1.1  # bandwidth-bound: the 1.25 ms target is below this floor


def test_a100_baselines_near_qserve_published_points():
    from accel_sim.validate import QSERVE_PUBLISHED_A100, cross_checks, format_cross_checks

    checks = cross_checks()
    assert [(c["model"], c["batch"], c["system"]) for c in checks] == [e[:3] for e in QSERVE_PUBLISHED_A100]
    for c in checks:
        assert c["error"] == pytest.approx((c["value_tok_s"] - c["published_tok_s"]) / c["published_tok_s"], abs=1e-3)
    # the README's cross-check: every simulated A100 point within -13 % .. +41 % of the published one
    assert all(-0.2 < c["error"] < 0.5 for c in checks), [round(c["error"], 3) for c in checks]
    assert "QServe W4A8KV4" in format_cross_checks(checks)


@pytest.mark.slow
def test_full_validation_table(tmp_path):
    from hetserve.cli import main

    out = tmp_path / "v.json"
    assert main(["sim", "validate", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert all({"name", "target", "value", "passed"} <= set(r) for r in rows)
    assert len(result["cross_checks"]) == 6
    assert [r["passed"] for r in rows if "OOM" in r["name"] or "fits" in r["name"]] == [True, True]


def test_cli_replay_writes_json(tmp_path):
    from hetserve.cli import main

    out = tmp_path / "r.json"
    assert main(["sim", "replay", "--limit", "300", "--pool", "oaken-lpddr:1,a100-vllm:2", "--json", str(out)]) == 0
    (s,) = json.loads(out.read_text())["results"]
    assert s["num_finished"] == 300 and s["system"] == "oaken-lpddr+a100-vllm" and s["replicas"] == 3


def test_cli_replay_with_layered_kv(tmp_path):
    from hetserve.cli import main

    runs = {}
    for policy in ("full", "layered"):
        out = tmp_path / f"{policy}.json"
        assert main(["sim", "replay", "--limit", "600", "--systems", "a100-vllm", "--model", "llama2-13b",
                     "--time-scale", "8", "--kv-policy", policy, "--json", str(out)]) == 0
        (runs[policy],) = json.loads(out.read_text())["results"]
    assert runs["layered"]["layered"] == {"full_layers": 3, "budget_tokens": None, "budget_ratio": 0.25}
    assert runs["layered"]["max_concurrency"] > runs["full"]["max_concurrency"]
    with pytest.raises(SystemExit, match="need --kv-policy layered"):
        main(["sim", "replay", "--limit", "10", "--kv-budget-tokens", "64"])


def test_cli_reports_bad_names_in_one_line():
    from hetserve.cli import main

    with pytest.raises(SystemExit, match="hetserve sim replay: unknown system 'tpu'"):
        main(["sim", "replay", "--systems", "tpu", "--limit", "10"])


# ---- the backend through the real HTTP server

def test_config_checks_the_numerics_format():
    from server.config import ServeConfig

    with pytest.raises(ValueError, match="--kv-format oaken"):
        ServeConfig(backend="sim", sim_device="oaken-lpddr", kv_format="fp16")
    with pytest.raises(ValueError, match="unknown sim device"):
        ServeConfig(backend="sim", sim_device="tpu-v9", kv_format="oaken")
    ServeConfig(backend="sim", sim_device="a100-vllm", kv_format="fp16")


def test_sim_backend_answers_with_simulated_timing():
    from server.config import ServeConfig
    from tests.conftest import RunningServer

    srv = RunningServer(ServeConfig(backend="sim", sim_device="oaken-lpddr", sim_model="llama2-13b",
                                    kv_format="oaken", kv_cache_bytes=64 * 2**20, max_num_seqs=8))
    try:
        # the warm-up requests are not traffic: /metrics and the virtual clock start from zero
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "hetserve_sim_steps_total" not in metrics and "hetserve:time_to_first_token_seconds_count 0" in metrics
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
        sim = body["x_sim"]
        # Llama2-13B on Oaken-LPDDR: each decode step reads 26 GB of weights at 0.99 TB/s, ~26 ms
        assert 0 < sim["ttft_s"] < sim["e2e_s"]
        assert 0.020 < sim["tpot_s"] < 0.035
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
                                "ignore_eos": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert "x_sim" in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"]
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "hetserve_sim_clock_seconds" in metrics and "hetserve_sim_output_tokens_total 12" in metrics
        assert "hetserve:time_to_first_token_seconds_count 2" in metrics
    finally:
        srv.close()


def test_sim_step_reads_only_the_rows_layered_kv_kept():
    from accel_sim.backend import step_work
    from hetcore.backend import SamplingParams, SeqChunk, StepInput
    from hetcore.kv_policy import KVPolicy, KVView

    layout = KVPolicy(kind="layered", full_layers=2, budget_tokens=256).layout(30, 8192)  # 1 full group, 14 sparse
    assert (layout.slots, layout.num_groups) == (2, 15)
    greedy = SamplingParams(temperature=0.0)
    view = KVView(((0,),) * 14, rows_before=(256,) * 14, keep_after=(257,) * 14)
    decode = SeqChunk(0, (5,), 1000, (0,), greedy, kv_view=view)
    full = step_work(StepInput((dataclasses.replace(decode, kv_view=None),)), layout=layout)
    layered = step_work(StepInput((decode,)), layout=layout)
    assert full.decode_kv_tokens == 1001  # no view: every layer holds the sequence
    # 2 layers hold 1000 rows, 28 hold 256: the earlier rows read are (2 * 1000 + 28 * 256) / 30 a layer
    assert layered.decode_kv_tokens == pytest.approx(1001 * (2 * 1000 + 28 * 256) / (30 * 1000))
    prompt = SeqChunk(0, tuple(range(64)), 1000, (0,), greedy, kv_view=view)
    read = step_work(StepInput((prompt,)), layout=layout).prefill_kv_read_tokens
    assert read == pytest.approx((2 * 1000 + 28 * 256) / 30)


@pytest.mark.parametrize("device,kv_format", [("a100-vllm", "fp16"), ("oaken-lpddr", "oaken")])
def test_sim_backend_serves_layered_kv(device, kv_format):
    from server.config import ServeConfig
    from tests.conftest import RunningServer

    srv = RunningServer(ServeConfig(backend="sim", sim_device=device, kv_format=kv_format, kv_policy="layered",
                                    kv_budget_tokens=64, kv_window=16, kv_cache_bytes=64 * 2**20, max_num_seqs=4))
    try:
        body = {"prompt": "one two three four " * 60, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and 0 < r.json()["x_sim"]["tpot_s"]
    finally:
        srv.close()
