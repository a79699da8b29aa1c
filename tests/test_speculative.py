"""Speculative decoding: n-gram drafts, the policy, the scheduler's draft accounting, acceptance, and
exactness end to end (the text equals the text without speculation, token for token)."""
import random
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hetcore.backend import Backend, KVSpec, SamplingParams, StepOutput, StepTimings
from server.block_manager import BlockManager
from server.config import ServeConfig
from server.hetero import accept
from server.scheduler import Scheduler, SchedulerConfig, Sequence
from server.speculative import TRUSTED_SAMPLES, NgramDrafter, SpecConfig, SpecPolicy
from gpu_model.sampler import sample
from loadgen.server_metrics import read_counters
from tests.conftest import SHARED, RunningServer

GREEDY = SamplingParams(temperature=0.0)


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def ngram_reference(tokens, k, lo, hi):
    """The latest earlier occurrence of the longest suffix of length lo..hi, by brute force."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tuple(tokens[i + n:i + n + k])
    return ()


def test_ngram_drafts_match_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(30):
        drafter = NgramDrafter(1 + trial % 2, 3 + trial % 3)
        tokens = [rng.randrange(6) for _ in range(5)]
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert drafter.propose(7, tokens, k) == ngram_reference(tokens, k, drafter.ngram_min, drafter.ngram_max)
            tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_ngram_drafts_copy_a_quoted_passage():
    passage = list(range(100, 140))
    tokens = [1, 2, 3] + passage + [9, 9] + passage[:5]
    assert NgramDrafter(2, 4).propose(0, tokens, 4) == tuple(passage[5:9])
    assert NgramDrafter(2, 4).propose(0, [1, 2, 3, 4], 4) == ()


def measure(policy: SpecPolicy, seconds: dict[int, float]) -> None:
    """Step times per number of tokens, each observed often enough to be its cost whatever the estimate."""
    for _ in range(TRUSTED_SAMPLES):
        for n, secs in seconds.items():
            policy.observe_step(n, secs)


def test_policy_sends_drafts_only_where_they_pay():
    policy = SpecPolicy(max_tokens=4)
    measure(policy, {5: 0.030})
    assert policy.plan(1, 1, [(0.99, 8)], 64) == [0]  # the step without drafts is measured first
    measure(policy, {1: 0.020, 2: 0.022, 3: 0.024, 4: 0.026, 5: 0.060})
    # likely drafts, cheap rows up to 4 tokens: three drafts (a fourth would make the step 2.3x dearer)
    assert policy.plan(1, 1, [(0.9, 8)], 64) == [3]
    # unlikely drafts cost more than they give
    assert policy.plan(1, 1, [(0.05, 8)], 64) == [0]
    # no more drafts than available, nor than the budget
    assert policy.plan(1, 1, [(0.9, 2)], 64) == [2]
    assert policy.plan(1, 1, [(0.9, 8)], 1) == [1]
    # two sequences: the likelier one drafts first
    measure(policy, {6: 0.061})
    ks = policy.plan(2, 2, [(0.3, 8), (0.95, 8)], 64)
    assert ks[1] >= ks[0] and sum(ks) <= 4


def test_policy_probes_backend_drafts_where_accepted_drafts_would_pay():
    """Self-drafts are learned only by sending them: with rates too low to draft, one step in explore_every sends each
    sequence one draft, where drafts that were all accepted would pay (at long contexts verification reads the KV
    once for every row), and never where even those would not (each draft costs a whole step)."""
    cheap = SpecPolicy(max_tokens=4)
    measure(cheap, {16: 0.40, 32: 0.50, 80: 0.90})
    plans = [cheap.plan(16, 16, [(0.1, 4)] * 16, 256, probe=True) for _ in range(2 * cheap.explore_every)]
    probes = [i for i, ks in enumerate(plans) if any(ks)]
    assert probes == [cheap.explore_every - 1, 2 * cheap.explore_every - 1]
    assert plans[probes[0]] == [1] * 16
    cheap.observe_outcome(16, 32, 16, 1.0)  # the probe's step, however slow, does not say drafting does not pay
    assert cheap.outcomes.get((16, True)) is None
    assert not any(any(cheap.plan(16, 16, [(0.1, 4)] * 16, 256)) for _ in range(2 * cheap.explore_every))
    dear = SpecPolicy(max_tokens=4)
    measure(dear, {n: 0.025 * n for n in range(16, 81)})
    assert not any(any(dear.plan(16, 16, [(0.1, 4)] * 16, 256, probe=True)) for _ in range(2 * dear.explore_every))


def test_policy_acceptance_rate_follows_what_was_accepted():
    policy = SpecPolicy(max_tokens=4)
    for _ in range(30):
        policy.observe_drafts(3, 4, 4)
    assert policy.rate(3) > 0.9
    for _ in range(30):
        policy.observe_drafts(3, 4, 0)
    assert policy.rate(3) < 0.2


def make_scheduler(num_blocks=32, block_size=4, budget=64, prefix_caching=False):
    blocks = BlockManager(KVSpec(block_size=block_size, num_blocks=num_blocks, bytes_per_block=100))
    cfg = SchedulerConfig(8, budget, prefix_caching, SpecConfig("ngram", num_tokens=4, ngram_min=2, ngram_max=3))
    return Scheduler(cfg, blocks), blocks


def test_scheduler_sends_drafts_and_keeps_only_the_accepted():
    s, blocks = make_scheduler(prefix_caching=True)
    measure(s.policy, {1: 0.02, 2: 0.021, 3: 0.022, 4: 0.023, 5: 0.024})
    for _ in range(5):
        s.policy.observe_drafts(0, 4, 4)  # a sequence whose drafts were accepted so far
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]  # the suffix 5 6 occurred before: drafts 7 8 9 10
    seq = Sequence(0, prompt, GREEDY)
    s.add(seq)
    inp = s.schedule()
    s.update(StepOutput(sampled={0: 7}))  # the prefill's token
    inp = s.schedule()
    (chunk,) = inp.chunks
    assert chunk.num_draft == 4 and chunk.token_ids == (7, 8, 9, 10, 11)
    assert chunk.start_pos == 9 and len(chunk.block_table) * 4 >= 14
    new = s.update(StepOutput(sampled={0: 42}, accepted={0: (8, 9)}))
    assert [t for _, t in new] == [8, 9, 42]
    assert seq.output_token_ids == [7, 8, 9, 42] and seq.num_computed == 12
    assert s.num_drafts == 1 and s.num_draft_tokens == 4 and s.num_accepted_tokens == 2
    # the prefix cache holds the blocks of accepted tokens only: positions 0..11, three full blocks
    assert len(blocks._key_of) == 2  # registered when scheduled: blocks 0-1 (positions 0..7) at that step
    inp = s.schedule()
    assert len(blocks._key_of) == 3  # now positions 8..11 are accepted and filled
    assert inp.chunks[0].start_pos == 12 and inp.chunks[0].token_ids[0] == 42


def test_scheduler_drafts_stop_at_max_tokens_and_skip_masked_sequences():
    s, _ = make_scheduler()
    measure(s.policy, {2: 0.02, 6: 0.021})  # two sequences decoding: the baseline, and with drafts
    capped = Sequence(0, [5, 6, 7, 8, 9, 5, 6], GREEDY, max_tokens=3)
    masked = Sequence(1, [5, 6, 7, 8, 9, 5, 6], GREEDY, speculate=False)
    for seq in (capped, masked):
        s.add(seq)
    s.schedule()
    s.update(StepOutput(sampled={0: 7, 1: 7}))
    inp = s.schedule()
    by_id = {c.seq_id: c for c in inp.chunks}
    assert by_id[0].num_draft == 1  # one output so far, the step samples one more: one draft left to max_tokens 3
    assert by_id[1].num_draft == 0


def test_acceptance_takes_the_longest_matching_prefix_and_the_targets_next_token():
    out = StepOutput(sampled={})
    lp = [(-0.1 * i, ()) for i in range(9)]
    accept([(0, (4, 5, 6)), (1, ()), (2, (8, 8))], [4, 5, 7, 1, 3, 9, 8, 2, 3], lp, out)
    assert out.sampled == {0: 7, 1: 3, 2: 9}
    assert out.accepted == {0: (4, 5), 2: ()}
    assert out.accepted_logprobs[0] == (lp[0], lp[1]) and out.logprobs[0] == lp[2] and out.logprobs[2] == lp[5]


def test_speculative_sampling_keeps_the_targets_distribution():
    """Toy vocabulary of 6: drafts from another distribution q (sampled with other seeds); the tokens emitted at
    the first two positions follow the target's p (chi-square, p > 0.01, 4,000 draws)."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 6, generator=gen) * 1.5
    q_logits = torch.randn(2, 6, generator=gen) * 1.5
    firsts, seconds = [], []
    for seed in range(4000):
        sp = SamplingParams(temperature=1.0, seed=seed)
        d1 = sample(q_logits[:1], [SamplingParams(temperature=1.0, seed=seed + 10**6)], [0])[0]
        tokens = sample(p_logits, [sp, sp], [0, 1])
        out = StepOutput(sampled={})
        accept([(0, (d1,))], tokens, [None, None], out)
        emitted = [*out.accepted[0], out.sampled[0]]
        firsts.append(emitted[0])
        if len(emitted) > 1:
            seconds.append(emitted[1])
    for observed, logits in ((firsts, p_logits[0]), (seconds, p_logits[1])):
        counts = np.bincount(observed, minlength=6)
        expected = logits.softmax(-1).double().numpy() * len(observed)
        assert chisquare_pvalue(counts, expected) > 0.01, (counts, expected)
    # and the test can fail: the draft's distribution q is not the target's
    q_counts = np.bincount([sample(q_logits[:1], [SamplingParams(temperature=1.0, seed=s)], [0])[0]
                            for s in range(4000)], minlength=6)
    assert chisquare_pvalue(q_counts, p_logits[0].softmax(-1).double().numpy() * 4000) < 0.01


def test_bad_speculative_settings_are_refused_at_start_up():
    with pytest.raises(ValueError, match="1..16"):
        ServeConfig(speculative_method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="needs kv_format fp16, fp32 or oaken"):
        ServeConfig(speculative_method="ngram", kv_format="int4")
    with pytest.raises(ValueError, match="lsh_window > num_speculative_tokens"):
        ServeConfig(speculative_method="ngram", kv_format="oaken", attention="magicpig", lsh_window=4)
    with pytest.raises(ValueError, match="self-mx needs kv_format fp16 or fp32"):
        ServeConfig(speculative_method="self-mx", kv_format="oaken")
    ServeConfig(speculative_method="ngram", kv_format="oaken")
    with pytest.raises(ValueError, match="must be one of"):
        ServeConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        ServeConfig(speculative_method="ngram", ngram_min=5, ngram_max=3)
    with pytest.raises(ValueError, match="needs executor local, or ray with ray_cpu_actors 0"):
        ServeConfig(speculative_method="self-sparse", kv_format="fp32", executor="ray", ray_cpu_actors=1)
    ServeConfig(speculative_method="self-sparse", kv_format="fp32", executor="ray")  # the model's actor holds the KV


PASSAGE = ("The mill on the river was built in 1820 by settlers from the east coast. It ground wheat and corn for "
           "the farms of the valley, and its wheel turned for more than a century before a flood destroyed it.")
PROMPTS = [
    f"Repeat the passage exactly.\n\nPassage: {PASSAGE}\n\nRepeated passage: The mill",
    f"{PASSAGE}\n\nQuestion: When was the mill built and what did it grind?\nAnswer:",
    "Once upon a time, in a small village, there lived",
]


@pytest.fixture(scope="module")
def spec_server():
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                    speculative_method="ngram", num_speculative_tokens=4))
    yield srv
    srv.close()


def complete(url, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0.0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("kw", [{}, {"frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {"13": 2}},
                                {"logprobs": 2, "stop": ["flood"]}])
def test_speculative_text_equals_text_without_it(server, spec_server, kw):
    """Greedy, fp32 KV and fp32 linears: every row's logits are the ones without speculation (to ~1e-6: a step's
    matmuls sum in an order that depends on its number of rows), so the same tokens come out. (Sampled text is
    the same too unless two tokens' perturbed logits tie to that precision; its distribution is tested above.)"""
    for prompt in PROMPTS:
        plain, spec = complete(server.url, prompt, **kw), complete(spec_server.url, prompt, **kw)
        assert spec["text"] == plain["text"] and spec["finish_reason"] == plain["finish_reason"]
        if "logprobs" in kw:
            a, b = plain["logprobs"], spec["logprobs"]
            assert a["tokens"] == b["tokens"]
            np.testing.assert_allclose(a["token_logprobs"], b["token_logprobs"], atol=1e-4)
    metrics = httpx.get(spec_server.url + "/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("hetserve:spec_decode_num_accepted_tokens")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_speculative_text_equals_text_without_it_concurrently(server, spec_server):
    import concurrent.futures as cf

    jobs = [(p, {"temperature": t, "seed": i}) for i, p in enumerate(PROMPTS * 2) for t in (0.0,)]
    with cf.ThreadPoolExecutor(6) as pool:
        plain = list(pool.map(lambda j: complete(server.url, j[0], **j[1])["text"], jobs))
        spec = list(pool.map(lambda j: complete(spec_server.url, j[0], **j[1])["text"], jobs))
    assert plain == spec


def test_loadgen_reads_the_servers_acceptance(spec_server):
    from loadgen.server_metrics import parse_counters, read_counters, speculation_summary

    before = read_counters(spec_server.url)
    complete(spec_server.url, PROMPTS[0])
    after = read_counters(spec_server.url)
    summary = speculation_summary(before, after)
    assert summary["spec_decode_draft_tokens"] > 0 and 0 < summary["spec_decode_acceptance_rate"] <= 1
    assert summary["spec_decode_mean_acceptance_length"] > 1
    # vLLM's names too, summed over labels
    text = ('# HELP x\nvllm:spec_decode_num_drafts_total{model="m"} 4\nvllm:spec_decode_num_draft_tokens_total 12\n'
            'vllm:spec_decode_num_accepted_tokens_total{model="m"} 3\nvllm:spec_decode_num_accepted_tokens_total{model="n"} 3\n')
    assert parse_counters(text) == {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12,
                                    "spec_decode_num_accepted_tokens": 6}
    assert speculation_summary({}, {}) == {}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("lens_rows", [[(37, 5), (16, 1), (30, 3), (1, 4)], [(700, 5)], [(702, 5)],
                                       [(702, 5), (650, 2)]], ids=["batch", "parts", "parts-edge", "two-uneven"])
def test_verify_attention_matches_a_numpy_reference_and_the_decode_kernel(dtype, lens_rows):
    """Rows of consecutive positions (a chunk with drafts) beside a one-row decode: each row's output is exact
    softmax attention over its own prefix (NumPy), and to the last bit the decode kernel's in a step of the same
    sequences at row index j's positions, its context cut into the parts that decode cuts it into
    (kernels.verify_row_groups). lens_rows:
    (first row's seq_len, rows) per sequence; "batch" crosses or meets block edges, "parts" is one sequence long
    enough to be cut into parts, its rows crossing a block's end; "two-uneven", two such sequences, one without rows
    in the second row group."""
    from cpu_attn.kernels import split_parts
    from cpu_attn.kv_store import PagedKVStore

    rng = np.random.default_rng(0)
    hkv, group, d, bs = 3, 3, 64, 16
    store = PagedKVStore(1, hkv, d, bs, 100, dtype)
    cut = split_parts(hkv * len(lens_rows), np.array([n + r - 1 for n, r in lens_rows]), bs)
    assert (cut > 1) == (len(lens_rows) <= 2)
    blocks, tables = list(rng.permutation(100)), []
    for n, r in lens_rows:  # disjoint blocks, in no order
        free = [int(blocks.pop()) for _ in range(-(-(n + r - 1) // bs))]
        tables.append(free)
        pos = np.arange(n + r - 1)
        slots = np.array([free[p // bs] * bs + p % bs for p in pos])
        store.write(0, slots, rng.standard_normal((len(pos), hkv, d), np.float32),
                    rng.standard_normal((len(pos), hkv, d), np.float32))
    num_rows = sum(r for _, r in lens_rows)
    q = rng.standard_normal((num_rows, hkv * group, d)).astype(np.float32)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    first = np.cumsum([0] + [r for _, r in lens_rows])[:-1].astype(np.int32)
    out, lse = store.verify_attention(0, q, bt, np.array([n for n, _ in lens_rows], np.int32), first,
                                      np.array([r for _, r in lens_rows], np.int32), d**-0.5)
    for i, (n, r) in enumerate(lens_rows):
        k, v = store.gather(0, tables[i], n + r - 1)
        for j in range(r):
            row = first[i] + j
            for h in range(hkv * group):
                s = k[: n + j, h // group] @ q[row, h] * d**-0.5
                p = np.exp(s - s.max())
                np.testing.assert_allclose(out[row, h], p @ v[: n + j, h // group] / p.sum(), rtol=2e-5, atol=2e-6)
                np.testing.assert_allclose(lse[row, h], s.max() + np.log(p.sum()), rtol=1e-5, atol=1e-5)
    for j in range(max(r for _, r in lens_rows)):  # row index j: a decode step of every sequence at that position
        rows = [first[i] + min(j, r - 1) for i, (_, r) in enumerate(lens_rows)]
        one, _ = store.decode_attention(0, q[rows], bt, np.array([n + j for n, _ in lens_rows], np.int32), d**-0.5)
        for i, (_, r) in enumerate(lens_rows):
            if j < r:
                np.testing.assert_array_equal(out[first[i] + j], one[i])


def test_draft_rows_over_oaken_and_magicpig_attend_as_decodes_of_their_positions():
    """The attention worker over Oaken KV (quantized on write) with MagicPIG sampling on layer 0: a chunk of a
    token and four drafts gives each row the output five one-token decodes give, one after another, over the
    same prompt; then a step that rewrites from the second draft (three rejected) leaves the worker's store and
    tables as the decodes of the accepted tokens alone."""
    from cpu_attn.magicpig import LshConfig, MagicPig
    from cpu_attn.worker import AttentionWorker, ChunkLayout
    from tests.test_kv_formats import oaken_store

    rng = np.random.default_rng(3)
    hkv, heads, d, prompt = 3, 6, 64, 300
    cfg = LshConfig(k=6, l=40, window=16, min_context=128, merge_every=8, dense_layers=(1,))
    table = tuple(range(3, 3 + 40))
    rows = {name: torch.from_numpy(rng.standard_normal((prompt + 12, n, d)).astype(np.float32))
            for name, n in (("q", heads), ("k", hkv), ("v", hkv))}

    def worker():
        mp = MagicPig(cfg, num_layers=2, num_kv_heads=hkv, head_dim=d)
        w = AttentionWorker(oaken_store(num_blocks=50), d, mp)
        w.coder = mp.coder()
        step(w, ChunkLayout(prompt, 0, table, 7))
        return w

    def step(w, layout):
        span = slice(layout.start_pos, layout.start_pos + layout.num_tokens)
        q, k, v = rows["q"][span], rows["k"][span], rows["v"][span]
        w.begin_step([layout])
        codes = w.coder.codes(0, q, k, [(7, layout.start_pos, layout.num_tokens, layout.num_draft)])
        return w.attend(0, q, k, v, codes)

    spec, plain = worker(), worker()
    verified = step(spec, ChunkLayout(5, prompt, table, 7, num_draft=4))
    decoded = torch.cat([step(plain, ChunkLayout(1, prompt + i, table, 7)) for i in range(5)])
    assert spec.sparse.touched > 0  # the rows were sampled, not attended exactly
    np.testing.assert_allclose(verified.numpy(), decoded.numpy(), rtol=1e-5, atol=1e-6)

    true = {name: x.clone() for name, x in rows.items()}
    for name in ("k", "v"):  # the drafts to be rejected: other tokens, other keys and values
        rows[name][prompt + 2:prompt + 5] = torch.randn(3, hkv, d)
    spec = worker()
    step(spec, ChunkLayout(5, prompt, table, 7, num_draft=4))
    rows.update(true)
    plain = worker()
    for i in range(2):
        step(plain, ChunkLayout(1, prompt + i, table, 7))
    for w in (spec, plain):
        for i in range(2, 10):
            step(w, ChunkLayout(1, prompt + i, table, 7))
    a, b = spec.sparse.seqs[7][0], plain.sparse.seqs[7][0]
    assert a.indexed == b.indexed > prompt - cfg.window
    np.testing.assert_array_equal(np.concatenate(a.pending), np.concatenate(b.pending))
    for x, y in zip(spec.store.gather(0, table, prompt + 10), plain.store.gather(0, table, prompt + 10)):
        np.testing.assert_array_equal(x, y)


def test_self_sparse_view_reads_the_sink_and_window_blocks_at_the_real_slot():
    from hetcore.backend import SeqChunk
    from server.self_draft import view_layout

    c = SeqChunk(0, (5,), 100, tuple(range(50, 58)), GREEDY, self_draft=3, draft_view=(16, 32))
    for j in range(3):
        lay = view_layout(c, j, 16)
        pos = 100 + j
        # blocks: the sinks' (block 0), then those holding positions pos - 31 .. pos
        assert lay.block_table == (50,) + tuple(range(50 + (pos - 31) // 16, 50 + pos // 16 + 1))
        assert lay.block_table[lay.start_pos // 16] * 16 + lay.start_pos % 16 == c.block_table[pos // 16] * 16 + pos % 16
        assert lay.start_pos + 1 == 16 + (pos + 1 - (pos - 31) // 16 * 16)  # the tokens it attends to
    short = SeqChunk(0, (5,), 20, tuple(range(50, 52)), GREEDY, self_draft=1, draft_view=(16, 32))
    assert view_layout(short, 0, 16).block_table == (50, 51) and view_layout(short, 0, 16).start_pos == 20


@pytest.fixture(scope="module")
def sparse_server():
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                    speculative_method="self-sparse", num_speculative_tokens=3,
                                    speculative_sinks=16, speculative_window=32))
    yield srv
    srv.close()


def test_self_sparse_text_equals_text_without_it(server, sparse_server):
    """The drafts attend to 16 + 32 tokens of a ~60-token context; the verification to all of it, so the
    text is the model's own."""
    for prompt in PROMPTS[:2]:
        plain, spec = complete(server.url, prompt), complete(sparse_server.url, prompt)
        assert spec["text"] == plain["text"]
    metrics = httpx.get(sparse_server.url + "/metrics").text
    sent = [line for line in metrics.splitlines() if line.startswith("hetserve:spec_decode_num_draft_tokens")]
    assert 'method="self-sparse"' in sent[0] and float(sent[0].split()[-1]) > 0


def repeat_passage_prompt() -> str:
    """A 600-token WikiText passage and the start of its first paragraph to repeat: n-gram drafts find matches."""
    passage = (SHARED / "data" / "wikitext-2" / "test.txt").read_text()[3000:5600]
    return f"{passage}\n\nRepeat the first paragraph above exactly:\n{passage[:80]}"


@pytest.mark.parametrize("attention", ["exact", "magicpig"])
def test_ngram_over_oaken_kv_gives_the_text_without_speculation(attention):
    """Oaken KV with its full-precision tails, exact attention or MagicPIG sampling past lsh_min_context, the
    default linears: the greedy text of a server without speculation, token for token, with drafts accepted and
    rejected. A short prompt, and a 600-token passage to repeat (sampled attention on the decode rows and the
    drafts' rows: each row attends as the one-token decode of its position would, to the last bit). The prompt
    is prefilled in one step and the output is shorter than a merge: MagicPIG's re-centering and merges run
    within a per-step budget, so where they are due they land at other positions when steps carry drafts."""
    common = dict(kv_format="oaken", attention=attention, lsh_min_context=256, kv_cache_bytes=256 * 2**20,
                  max_num_batched_tokens=1024)
    plain, spec = (RunningServer(ServeConfig(**common, **kw))
                   for kw in ({}, dict(speculative_method="ngram", num_speculative_tokens=4)))
    try:
        for prompt in (PROMPTS[2], repeat_passage_prompt()):
            texts = [complete(srv.url, prompt, max_tokens=80)["text"] for srv in (plain, spec)]
            assert texts[0] == texts[1]
        counts = read_counters(spec.url)
        # drafts accepted, and some rejected: their rows were written, then written again (how many the policy
        # sends follows the measured step times, so the counts vary with the machine's load)
        assert 0 < counts["spec_decode_num_accepted_tokens"] < counts["spec_decode_num_draft_tokens"]
    finally:
        plain.close()
        spec.close()


@pytest.mark.slow
def test_ngram_on_the_ray_executor_gives_the_text_without_speculation(server):
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                    executor="ray", ray_cpu_actors=1, speculative_method="ngram"))
    try:
        for prompt in PROMPTS[:2]:
            assert complete(srv.url, prompt)["text"] == complete(server.url, prompt)["text"]
        metrics = httpx.get(srv.url + "/metrics").text
        accepted = [line for line in metrics.splitlines() if line.startswith("hetserve:spec_decode_num_accepted")]
        assert float(accepted[0].split()[-1]) > 0
    finally:
        srv.close()


@pytest.mark.slow
def test_ngram_over_oaken_and_magicpig_on_a_ray_attention_actor_gives_the_text_without_speculation():
    """The same over a Ray CPU attention actor, which marks the drafts' rows itself from the layouts it gets."""
    common = dict(kv_format="oaken", attention="magicpig", lsh_min_context=256, kv_cache_bytes=256 * 2**20,
                  max_num_batched_tokens=1024)
    plain, spec = (RunningServer(ServeConfig(**common, **kw)) for kw in (
        {}, dict(executor="ray", ray_cpu_actors=1, speculative_method="ngram")))
    try:
        for prompt in (PROMPTS[2], repeat_passage_prompt()):
            texts = [complete(srv.url, prompt, max_tokens=80)["text"] for srv in (plain, spec)]
            assert texts[0] == texts[1]
        assert read_counters(spec.url)["spec_decode_num_accepted_tokens"] > 0
    finally:
        plain.close()
        spec.close()


def test_policy_stops_drafting_where_drafted_steps_emitted_less_and_explores():
    policy = SpecPolicy(max_tokens=4)
    measure(policy, {1: 0.020, 2: 0.021, 3: 0.022, 4: 0.023, 5: 0.024})
    assert policy.plan(1, 1, [(0.9, 8)], 64) == [4]
    for _ in range(policy.min_outcomes):  # what the drafted steps really gave: 1.2 tokens in 40 ms, against 1 in 20
        assert policy.drafting_pays(1)  # until enough drafted steps were seen
        policy.observe_outcome(1, 5, 1.2, 0.040)
        policy.observe_outcome(1, 1, 1, 0.020)
    assert not policy.drafting_pays(1)
    plans = [policy.plan(1, 1, [(0.9, 8)], 64) for _ in range(32)]
    assert sum(p != [0] for p in plans) == 2  # one step in 16 still drafts
    for _ in range(30):
        policy.observe_outcome(1, 5, 3.0, 0.030)
    assert policy.drafting_pays(1) and policy.plan(1, 1, [(0.9, 8)], 64) == [4]


def test_policy_outlives_one_slow_step():
    """A stall on a size's first step (a kernel loaded on first use) neither fixes that size's cost nor
    stops drafting: the size is tried again until its median is trusted, and a drafted step counts as at
    most its tokens' worth of draft-free steps."""
    policy = SpecPolicy(max_tokens=4)
    measure(policy, {1: 0.010})
    assert policy.plan(1, 1, [(0.9, 8)], 64) == [4]
    policy.observe_step(5, 18.0)
    policy.observe_outcome(1, 5, 2, 18.0)
    policy.observe_outcome(1, 1, 1, 0.010)
    assert policy.plan(1, 1, [(0.9, 8)], 64) == [4]  # one sample: the estimate, not the stall
    for _ in range(TRUSTED_SAMPLES - 1):
        policy.observe_step(5, 0.015)
        policy.observe_outcome(1, 5, 4, 0.015)
    assert policy.cost(5) == 0.015 and policy.drafting_pays(1)
    assert policy.plan(1, 1, [(0.9, 8)], 64) == [4]
    policy.observe_step(9, 0.025)  # a plausible first measurement is the size's cost at once
    assert policy.cost(9) == 0.025
    policy.observe_step(3, 0.020)  # fewer tokens never cost more than more tokens measured
    assert policy.cost(3) == 0.015


def binned(tokens, top: list[int]) -> np.ndarray:
    """Counts of each of `top`'s tokens, then of all the others."""
    index = {t: i for i, t in enumerate(top)}
    return np.bincount([index.get(t, len(top)) for t in tokens], minlength=len(top) + 1)


def test_speculative_sampling_keeps_the_real_models_distribution():
    """The real model (fp32), a prompt and one draft token: over 2,000 seeds at temperature 1, the first emitted
    token follows the model's distribution at the prompt's end, and the second (when the draft was accepted)
    its distribution after the draft (chi-square over the 9 likeliest tokens and the rest, p > 0.01)."""
    from gpu_model.loader import resolve_model_dir
    from hetcore.backend import SeqChunk, StepInput
    from server.backend_config import BackendConfig
    from server.hetero import HeteroBackend, flatten, sample_batches

    backend = HeteroBackend(resolve_model_dir(None, Path("~/.cache/hetserve/models").expanduser()),
                            BackendConfig(kv_format="fp32", kv_capacity_bytes=32 * 2**20, cpu_linear_dtype="float32"))
    prompt = (504, 3575, 282, 4649, 314)  # "The capital of France is"; the draft: " Paris"
    params = SamplingParams(temperature=1.0)
    backend.step(StepInput((SeqChunk(0, prompt[:-1], 0, (0,), None),)))
    draft = 7042
    chunk = SeqChunk(0, (prompt[-1], draft), len(prompt) - 1, (0,), params, num_draft=1)
    batch = flatten(StepInput((chunk,)))
    backend.attn_worker.begin_step(batch.layouts)
    logits, _ = backend.model_worker.forward(batch.token_ids, batch.positions, batch.logit_rows,
                                             backend.attn_worker.attend, batch.chunks)
    firsts, seconds = [], []
    for seed in range(2000):
        seeded = SamplingParams(temperature=1.0, seed=seed)
        batch.params = [seeded, seeded]
        out = sample_batches([logits], [batch])
        emitted = [*out.accepted[0], out.sampled[0]]
        firsts.append(emitted[0])
        if len(emitted) > 1:
            seconds.append(emitted[1])
    assert len(seconds) > 100  # the draft is accepted often enough to test the second position
    for observed, row in ((firsts, logits[0]), (seconds, logits[1])):
        p = row.double().softmax(-1)
        top = p.topk(9).indices.tolist()
        expected = np.append(p[top].numpy(), 1 - p[top].sum().item()) * len(observed)
        assert chisquare_pvalue(binned(observed, top), expected) > 0.01


def test_self_draft_methods_name_their_view_and_weights():
    from hetcore.backend import SeqChunk
    from server.self_draft import view_layout

    assert SpecConfig("self-sparse").draft_view == (16, 256) and SpecConfig("self-sparse").draft_weight_format is None
    assert SpecConfig("self-mx").draft_view == (0, 0) and SpecConfig("self-mx").draft_weight_format == "mxfp4"
    assert SpecConfig("self-mx-sparse", draft_sinks=4, draft_window=64).draft_view == (4, 64)
    whole = SeqChunk(0, (5,), 100, tuple(range(50, 58)), GREEDY, self_draft=2, draft_view=(0, 0))
    assert view_layout(whole, 1, 16).block_table == tuple(range(50, 57)) and view_layout(whole, 1, 16).start_pos == 101


@pytest.mark.slow
def test_self_mx_text_equals_text_without_it(server):
    """A copy of the model with MXFP4 weights drafts; the fp32 model verifies: its greedy text."""
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                    speculative_method="self-mx", num_speculative_tokens=3))
    try:
        for prompt in PROMPTS[:2]:
            assert complete(srv.url, prompt)["text"] == complete(server.url, prompt)["text"]
        metrics = httpx.get(srv.url + "/metrics").text
        sent = [line for line in metrics.splitlines() if line.startswith("hetserve:spec_decode_num_draft_tokens")]
        assert 'method="self-mx"' in sent[0] and float(sent[0].split()[-1]) > 0
    finally:
        srv.close()


def test_constrained_requests_speculate_within_their_grammar(server, spec_server):
    """n-gram drafts for a JSON-schema request: each draft row is sampled under the grammar's mask after the
    drafts before it, so the output is the one without speculation, and valid."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                        "maxItems": 6}},
              "required": ["name", "tags"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Give a name and many color tags, as JSON."}], "max_tokens": 80,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    before = float([line for line in httpx.get(spec_server.url + "/metrics").text.splitlines()
                    if line.startswith("hetserve:spec_decode_num_draft_tokens")][0].split()[-1])
    texts = []
    for srv in (server, spec_server):
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    import json
    import jsonschema
    jsonschema.validate(json.loads(texts[1]), schema)
    after = float([line for line in httpx.get(spec_server.url + "/metrics").text.splitlines()
                   if line.startswith("hetserve:spec_decode_num_draft_tokens")][0].split()[-1])
    assert after > before  # it did speculate


class RepeatingBackend(Backend):
    """Continues a repeating pattern of tokens with every draft accepted (a decode step of a drafting sequence brings
    1 + its drafts); step times that make drafting pay."""

    def __init__(self, pattern: list[int]):
        self.pattern = pattern
        self.kv_spec, self.max_model_len = KVSpec(16, 256, 1024), 4096
        self.model_cfg = types.SimpleNamespace(eos_token_ids=())

    def step(self, inp):
        sampled, accepted = {}, {}
        for c in inp.chunks:
            if c.sampling is not None:
                drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
                end = c.start_pos + len(c.token_ids)
                assert list(drafts) == [self.pattern[p % len(self.pattern)] for p in range(end - len(drafts), end)]
                accepted[c.seq_id], sampled[c.seq_id] = drafts, self.pattern[end % len(self.pattern)]
        tokens = sum(len(c.token_ids) for c in inp.chunks)
        return StepOutput(sampled, accepted=accepted, timings=StepTimings(0.01, 0.0, 0.01 + 1e-4 * tokens))

    def close(self):
        pass


def test_a_step_that_reaches_max_tokens_with_drafts_sends_every_token():
    """Steps of several tokens (accepted drafts) that end exactly at max_tokens: every token is sent to the client
    and counted once (an earlier engine finished at the step's first token and dropped the rest), and a step's
    tokens go out as one event, not one each."""
    import threading

    from gpu_model.loader import resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from server.engine import Engine
    from server.request import EngineRequest

    tok = Tokenizer(resolve_model_dir(None), ())
    pattern = tok.encode(" one two three four five six seven")
    engine = Engine(RepeatingBackend(pattern), tok, SchedulerConfig(4, 512, False, SpecConfig("ngram", 4)))
    threading.Thread(target=engine.run, daemon=True).start()
    try:
        for max_tokens in (12, 13, 9):
            events, done = [], threading.Event()

            def on_event(ev, events=events, done=done):
                events.append(ev)
                if ev.finish_reason:
                    done.set()

            prompt = pattern * 3
            engine.submit(EngineRequest(f"r{max_tokens}", prompt, GREEDY, max_tokens, on_event=on_event))
            assert done.wait(60)
            tokens = [t for ev in events for t in ev.token_ids]
            want = [pattern[p % len(pattern)] for p in range(len(prompt), len(prompt) + max_tokens)]
            assert tokens == want and "".join(ev.text for ev in events) == tok.decode(want)
            assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == max_tokens
            counts = [len(ev.token_ids) for ev in events]
            assert [ev.num_output_tokens for ev in events] == list(np.cumsum(counts)) and max(counts) > 1
        assert engine.scheduler.num_accepted_tokens > 0
    finally:
        engine.stop()
