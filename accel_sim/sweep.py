"""Throughput sweeps like the Oaken paper's Figure 11 (vs batch size, 1K in / 1K out) and
Figure 13 (vs total sequence length at batch 16): rows, a text table and a PNG.

Throughput is end-to-end generation throughput of a closed batch: all requests arrive at
t = 0, generated tokens / time until the last one finishes (prefill included). In the batch
sweep a system whose memory cannot hold the whole batch runs fewer sequences at once (its
scheduler admits what fits and preempts on pressure: the paper's "saturation"); in the length
sweep such a point is marked OOM (`fits` false), the paper's failure criterion.
"""
from __future__ import annotations

from accel_sim.hardware import load_device, make_system, SYSTEMS
from accel_sim.models import PAPER_GPU_COUNT, get_model
from accel_sim.sim import SchedulerLimits, simulate
from accel_sim.workloads import fixed_batch

DEFAULT_SYSTEMS = ("oaken-lpddr", "oaken-hbm", "a100-vllm", "a100-kivi", "a100-qserve")
BATCHES = (16, 32, 64, 128, 256)
SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)


def paper_num_devices(system: str, model: str) -> int | None:
    """The paper's setup: 80-GB devices (A100, and Oaken-HBM with the A100's memory) take one or two
    per model as in §7; None (fewest that fit) for the others."""
    mem = load_device(SYSTEMS[system][0]).mem_bytes
    return PAPER_GPU_COUNT.get(model) if mem <= 80e9 else None


def run_point(system: str, model: str, batch: int, prompt_tokens: int, output_tokens: int,
              num_devices: int | None = None, max_num_batched_tokens: int = 2048) -> dict:
    sys_ = make_system(system, get_model(model), num_devices or paper_num_devices(system, model))
    row = {"model": model, "system": system, "num_devices": sys_.num_devices, "batch": batch,
           "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
           "seq_len": prompt_tokens + output_tokens,
           "fits": sys_.fits_batch(batch, prompt_tokens + output_tokens)}
    if sys_.kv_capacity_tokens < prompt_tokens + output_tokens:
        return {**row, "gen_tok_s": 0.0, "max_concurrency": 0, "note": "weights or one sequence do not fit"}
    res = simulate([sys_], fixed_batch(batch, prompt_tokens, output_tokens),
                   SchedulerLimits(max_num_seqs=batch, max_num_batched_tokens=max_num_batched_tokens))
    s = res.summary()
    return {**row, "gen_tok_s": s["gen_tok_s"], "max_concurrency": s["max_concurrency"],
            "num_preemptions": s["num_preemptions"], "makespan_s": s["makespan_s"],
            "j_per_gen_token": s["j_per_gen_token"]}


def sweep_batch(models, systems=DEFAULT_SYSTEMS, batches=BATCHES, prompt_tokens=1024, output_tokens=1024) -> list[dict]:
    return [run_point(s, m, b, prompt_tokens, output_tokens) for m in models for s in systems for b in batches]


def sweep_seq_len(models, systems=DEFAULT_SYSTEMS, seq_lens=SEQ_LENS, batch=16) -> list[dict]:
    """Total length split evenly between prompt and output."""
    return [run_point(s, m, batch, n // 2, n - n // 2) for m in models for s in systems for n in seq_lens]


def format_table(rows: list[dict], x: str) -> str:
    """One line per (model, system), one column per x value; OOM points flagged."""
    xs = sorted({r[x] for r in rows})
    lines = [f"{'model':14} {'system':12} {'dev':>3} " + " ".join(f"{v:>9}" for v in xs) + "   (gen tok/s)"]
    keys = list(dict.fromkeys((r["model"], r["system"]) for r in rows))
    for model, system in keys:
        cells = {r[x]: r for r in rows if r["model"] == model and r["system"] == system}
        dev = next(iter(cells.values()))["num_devices"]
        def cell(v):
            r = cells.get(v)
            if r is None:
                return f"{'':>9}"
            if x == "seq_len" and not r["fits"]:
                return f"{'OOM':>9}"
            return f"{r['gen_tok_s']:9.0f}"
        lines.append(f"{model:14} {system:12} {dev:3d} " + " ".join(cell(v) for v in xs))
    return "\n".join(lines)


def plot(rows: list[dict], x: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    ncols = min(3, len(models))
    nrows = -(-len(models) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(4.2 * ncols, 6.5), 3.3 * nrows), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        for system in systems:
            pts = sorted((r[x], r) for r in rows if r["model"] == model and r["system"] == system)
            ok = [(v, r["gen_tok_s"]) for v, r in pts if x != "seq_len" or r["fits"]]
            oom = [v for v, r in pts if x == "seq_len" and not r["fits"]]
            line, = ax.plot([v for v, _ in ok], [t for _, t in ok], marker="o", ms=3, label=system)
            if oom:
                ax.plot(oom, [0] * len(oom), "x", color=line.get_color(), ms=7)
        ax.set_xscale("log", base=2)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("batch size" if x == "batch" else "total sequence length (x = OOM)", fontsize=8)
        ax.tick_params(labelsize=7)
    for row in axes:
        row[0].set_ylabel("generation throughput (tok/s)", fontsize=8)
    axes.flat[len(models) - 1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
