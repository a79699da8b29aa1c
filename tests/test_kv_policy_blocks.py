"""Layered KV sparsity's block accounting: per-group tables, eviction freeing blocks after the step, and
admission seeing the room. Pure Python, no model."""
import pytest

from hetcore.backend import KVSpec, SamplingParams, StepOutput
from hetcore.kv_policy import KVPolicy
from server.block_manager import BlockManager
from server.scheduler import Scheduler, SchedulerConfig, Sequence

GREEDY = SamplingParams(temperature=0.0)
# 4 layers: group 0 = layer 0-1 (full), group 1 = layers 2-3 (budget 8: sinks 2 + window 2 + 4 scored)
POLICY = KVPolicy("layered", full_layers=2, budget_tokens=8, window=2, sinks=2, evict_slack=4)


def make(num_blocks=40, budget=16, max_num_seqs=8):
    spec = KVSpec(block_size=4, num_blocks=num_blocks, bytes_per_block=100, kv_layout=POLICY.layout(4, 1024))
    blocks = BlockManager(spec)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, prefix_caching=True), blocks), blocks


def step(s: Scheduler):
    inp = s.schedule()
    s.update(StepOutput(sampled={c.seq_id: 7 for c in inp.chunks if c.sampling is not None}))
    return inp


def test_prompt_holds_every_row_until_its_end_then_the_evicted_blocks_go_free_after_the_step():
    s, blocks = make(budget=12)
    s.add(Sequence(0, list(range(20)), GREEDY))
    first = step(s).chunks[0]  # 12 of 20 prompt tokens: every group holds them
    assert first.block_table == (0, 1, 2) and first.kv_view.tables == ((3, 4, 5),)
    assert (first.kv_view.rows_before, first.kv_view.keep_after) == ((0,), (12,))
    inp = s.schedule()  # the prompt's last 8 tokens: 20 rows, then 8 kept (20 > 8 + 4)
    last = inp.chunks[0]
    assert last.block_table == (0, 1, 2, 6, 7) and last.kv_view.tables == ((3, 4, 5, 8, 9),)
    assert (last.kv_view.rows_before, last.kv_view.keep_after) == ((12,), (8,))
    assert blocks.group_used_blocks() == [5, 5]  # the step has not run: its blocks stay held
    s.update(StepOutput(sampled={0: 7}))
    assert blocks.group_used_blocks() == [5, 2] and blocks.num_free_blocks == 33
    views = [step(s).chunks[0].kv_view for _ in range(5)]  # 4 decodes grow to 12 rows; the 5th evicts again
    assert [(v.rows_before[0], v.keep_after[0]) for v in views] == [(8, 9), (9, 10), (10, 11), (11, 12), (12, 8)]
    assert views[0].tables == ((3, 4, 11),) and blocks.group_used_blocks() == [7, 2]
    s.finish(s.running[0])
    assert blocks.num_free_blocks == 40 and blocks.group_used_blocks() == [0, 0]


def peak_running(layout, num_blocks: int, num_seqs: int = 6, prompt: int = 40, outputs: int = 20) -> int:
    """The most sequences running at once when `num_seqs` requests of `prompt` + `outputs` tokens share
    `num_blocks` blocks (block_size 4, a step budget of 16 tokens)."""
    spec = KVSpec(block_size=4, num_blocks=num_blocks, bytes_per_block=100, kv_layout=layout)
    s = Scheduler(SchedulerConfig(8, 16), BlockManager(spec))
    seqs = [Sequence(i, list(range(100 * i, 100 * i + prompt)), GREEDY) for i in range(num_seqs)]
    for seq in seqs:
        s.add(seq)
    peak = 0
    while s.has_work():
        step(s)
        peak = max(peak, len(s.running))
        for seq in [q for q in s.running if len(q.output_token_ids) >= outputs]:
            s.finish(seq)
    assert s.blocks.num_free_blocks == num_blocks and not s.too_long
    return peak


def test_admission_sees_what_eviction_freed():
    """The same bytes: 30 blocks of every layer, or 60 blocks of one of two layer groups. A sequence's
    sparse group keeps 3 blocks (budget 8 + slack 4 rows) once its prompt has ended, so one more
    sequence runs at once (half the layers are full here: the gain is that half's)."""
    assert peak_running(None, 30) == 3
    assert peak_running(POLICY.layout(4, 1024), 60) == 4


def test_no_prefix_cache_hits_under_a_layered_layout():
    s, blocks = make(budget=32)
    prompt = list(range(17))
    s.add(Sequence(0, prompt, GREEDY))
    step(s)
    s.add(Sequence(1, prompt, GREEDY))
    inp = step(s)
    assert [c.start_pos for c in inp.chunks] == [17, 0] and blocks.hit_tokens == 0


def test_preempted_sequence_releases_every_group_and_starts_over():
    s, blocks = make(num_blocks=14, budget=32, max_num_seqs=4)
    s.add(Sequence(0, list(range(12)), GREEDY))
    s.add(Sequence(1, list(range(50, 62)), GREEDY))
    step(s)
    assert blocks.group_used_blocks() == [6, 6]
    for _ in range(12):
        step(s)
    assert s.num_preemptions >= 0 and sum(blocks.group_used_blocks()) <= 14
    for seq in list(s.running):
        s.finish(seq)
    assert blocks.num_free_blocks == 14


@pytest.mark.parametrize("policy", [KVPolicy(), POLICY])
def test_one_group_without_layered(policy):
    spec = KVSpec(block_size=4, num_blocks=8, bytes_per_block=100, kv_layout=policy.layout(4, 1024))
    blocks = BlockManager(spec)
    blocks.allocate(0, 9)
    assert blocks.advance(0, 9, True) is None if not policy.is_layered else blocks.advance(0, 9, True) is not None
