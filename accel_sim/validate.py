"""The simulator against the Oaken paper's published numbers: the validation table of `hetserve sim validate`.

Readings (stated, not tuned):
- 1.79x / 1.58x: Oaken-LPDDR over A100 vLLM fp16 / QServe KV4 at batch 256, 1K in / 1K out,
  arithmetic mean of the per-model ratios over the six Figure 11 models. The paper's text (§7,
  "Throughput") gives both to Oaken-LPDDR; the Oaken-HBM ratios are reported as extra rows.
  Large models run on two A100s (and two Oaken-HBMs) in pipeline parallel, Oaken-LPDDR on one.
- OOM: Figure 13 setup (Llama2-13B, batch 16, total length 1K..32K split evenly between prompt
  and output); a point fails when the batch's KV at full length does not fit beside the weights.
- "GPU baselines ahead below ~8K": the best A100 system (vLLM, KIVI, QServe) out-runs Oaken at
  every length below 8K; the crossover is the shortest length where Oaken is at least as fast
  (a GPU that is OOM counts as behind).
- LPU: one LPU-style device (the Oaken core without the Oaken modules, fp16 KV) with the HBM of
  Oaken-HBM, OPT-1.3B, batch 1, 128-token prompt, mean time per output token over 1024 tokens.

Cross-checks (not targets of the issue, no pass/fail): the A100 baselines against the absolute
throughputs QServe's authors published for A100 80GB (1024 in / 512 out, maximum throughput, at
their batch sizes), for the three single-GPU models both papers use.
"""
from __future__ import annotations

from statistics import geometric_mean, mean

from accel_sim.hardware import make_system
from accel_sim.models import PAPER_FIG11_MODELS, get_model
from accel_sim.sim import SchedulerLimits, simulate
from accel_sim.sweep import SEQ_LENS, run_point
from accel_sim.workloads import fixed_batch

GPU_BASELINES = ("a100-vllm", "a100-kivi", "a100-qserve")


# (model, batch, system, published gen tok/s, what ran): QServe README "Efficiency Benchmarks", A100 (80G)
# table (github.com/mit-han-lab/qserve; QServe paper, arXiv 2405.04532), 1024 in / 512 out
QSERVE_PUBLISHED_A100 = (
    ("llama2-7b", 190, "a100-qserve", 2908, "QServe W4A8KV4"),
    ("llama2-13b", 128, "a100-qserve", 1741, "QServe W4A8KV4"),
    ("mistral-7b", 256, "a100-qserve", 2970, "QServe W4A8KV4"),
    ("llama2-7b", 190, "a100-vllm", 1549, "TRT-LLM fp16"),
    ("llama2-13b", 128, "a100-vllm", 488, "TRT-LLM fp16"),
    ("mistral-7b", 256, "a100-vllm", 2371, "TRT-LLM fp16"),
)


def _row(name: str, target, value, passed: bool, note: str = "", tolerance: float | None = None) -> dict:
    """A validation row; `error` only where the target is a number to come close to (a tolerance)."""
    row = {"name": name, "target": target, "value": value, "passed": bool(passed), "note": note}
    if tolerance is not None:
        row["error"] = (value - target) / target
        row["tolerance"] = tolerance
    return row


def throughput_ratios(oaken: str, baseline: str, models=PAPER_FIG11_MODELS, batch: int = 256) -> dict[str, float]:
    return {m: run_point(oaken, m, batch, 1024, 1024)["gen_tok_s"] / run_point(baseline, m, batch, 1024, 1024)["gen_tok_s"]
            for m in models}


def _ratio_row(oaken: str, baseline: str, target: float, note: str) -> dict:
    ratios = throughput_ratios(oaken, baseline)
    value = mean(ratios.values())
    detail = ", ".join(f"{m} {r:.2f}" for m, r in ratios.items())
    return {**_row(f"{oaken} / {baseline} throughput, batch 256, 1K/1K, mean of 6 models", target, round(value, 3),
                   abs(value - target) <= 0.15 * target, f"{note}per model: {detail}; geomean {geometric_mean(ratios.values()):.2f}",
                   tolerance=0.15), "per_model": ratios}


def _length_points(system: str) -> list[dict]:
    return [run_point(system, "llama2-13b", 16, n // 2, n - n // 2) for n in SEQ_LENS]


def _crossover(oaken_pts: list[dict], gpu_pts: dict[str, list[dict]]) -> int | None:
    for i, o in enumerate(oaken_pts):
        best = max((pts[i]["gen_tok_s"] for pts in gpu_pts.values() if pts[i]["fits"]), default=0.0)
        if o["fits"] and o["gen_tok_s"] >= best:
            return o["seq_len"]
    return None


def lpu_ms_per_token(system: str = "lpu-hbm", model: str = "opt-1.3b") -> float:
    sys_ = make_system(system, get_model(model), 1)
    res = simulate([sys_], fixed_batch(1, 128, 1024), SchedulerLimits(max_num_seqs=1))
    return res.summary()["tpot_mean_s"] * 1e3


def validate() -> dict:
    rows = [
        _ratio_row("oaken-lpddr", "a100-vllm", 1.79, ""),
        _ratio_row("oaken-lpddr", "a100-qserve", 1.58, ""),
        _ratio_row("oaken-hbm", "a100-vllm", 1.79, "other reading (slides): "),
        _ratio_row("oaken-hbm", "a100-qserve", 1.58, "other reading (slides): "),
    ]
    lp, hbm = _length_points("oaken-lpddr"), _length_points("oaken-hbm")
    first_oom = next((p["seq_len"] for p in hbm if not p["fits"]), None)
    rows.append(_row("oaken-hbm llama2-13b batch 16: shortest total length that is OOM", 16384, first_oom,
                     first_oom == 16384, "fits at " + ", ".join(str(p["seq_len"]) for p in hbm if p["fits"])))
    longest = max((p["seq_len"] for p in lp if p["fits"]), default=None)
    rows.append(_row("oaken-lpddr llama2-13b batch 16: longest total length that fits", 32768, longest,
                     longest is not None and longest >= 32768))
    gpus = {g: _length_points(g) for g in GPU_BASELINES}
    for name, pts in (("oaken-lpddr", lp), ("oaken-hbm", hbm)):
        cross = _crossover(pts, gpus)
        table = "; ".join(f"{p['seq_len']}: {name} {p['gen_tok_s']:.0f} vs best GPU "
                          f"{max((g[i]['gen_tok_s'] for g in gpus.values() if g[i]['fits']), default=0):.0f}"
                          for i, p in enumerate(pts) if p["fits"])
        rows.append(_row(f"llama2-13b batch 16: shortest length where {name} >= best A100 baseline (GPU ahead below)",
                         8192, cross, cross is not None and 8192 <= cross <= 16384,
                         f"pass when the GPUs lead below 8K and Oaken leads by 16K; {table}"))
    ms = lpu_ms_per_token()
    lpu = make_system("lpu-hbm", get_model("opt-1.3b"), 1)
    floor_ms = lpu.weight_bytes / lpu.device.mem_bw_bytes_s * 1e3
    implied_tb_s = lpu.weight_bytes / 1.25e-3 / lpu.device.eta_mem / 1e12
    rows.append(_row("LPU-style batch-1 OPT-1.3B ms/token (lpu-hbm: 2.0 TB/s)", 1.25, round(ms, 3),
                     abs(ms - 1.25) <= 0.10 * 1.25,
                     f"LPU paper (arXiv 2408.07326): 1.25 ms/token; {lpu.weight_bytes / 1e9:.2f} GB of fp16 weights read "
                     f"per token take {floor_ms:.2f} ms even at 100 % of 2.0 TB/s; 1.25 ms at the LPU's 90 % "
                     f"utilization implies {implied_tb_s:.2f} TB/s of memory, while the paper's two-device OPT-66B "
                     f"figure (20.9 ms/token) implies >= 3.1 TB/s per device, at which 1.25 ms is ~63 % utilization: "
                     f"no single bandwidth and utilization fits both (accel_sim/README.md)", tolerance=0.10))
    return {"rows": rows, "num_passed": sum(r["passed"] for r in rows), "num_rows": len(rows),
            "cross_checks": cross_checks()}


def cross_checks() -> list[dict]:
    """The A100 systems at QServe's published benchmark points, against the published throughput."""
    out = []
    for model, batch, system, published, ran in QSERVE_PUBLISHED_A100:
        value = run_point(system, model, batch, 1024, 512)["gen_tok_s"]
        out.append({"model": model, "batch": batch, "system": system, "published_tok_s": published,
                    "published_system": ran, "value_tok_s": round(value, 1), "error": (value - published) / published})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'':4} {'target':>8} {'value':>8} {'error':>7}  name"]
    for r in rows:
        err = f"{r['error']:+7.1%}" if "error" in r else f"{'':>7}"
        lines.append(f"{'PASS' if r['passed'] else 'FAIL':4} {str(r['target']):>8} {str(r['value']):>8} {err}  {r['name']}")
        if r.get("note"):
            lines.append(f"{'':31}{r['note']}")
    return "\n".join(lines)


def format_cross_checks(checks: list[dict]) -> str:
    lines = ["cross-check: A100 systems at QServe's published A100 points (1024 in / 512 out; QServe README)",
             f"{'model':12} {'batch':>5} {'system':12} {'simulated':>9} {'published':>9} {'error':>7}  published"]
    for c in checks:
        lines.append(f"{c['model']:12} {c['batch']:5} {c['system']:12} {c['value_tok_s']:9.0f} "
                     f"{c['published_tok_s']:9} {c['error']:+7.1%}  {c['published_system']}")
    return "\n".join(lines)
