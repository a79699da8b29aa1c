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
    # the sparse group keeps room for budget + slack + 1 rows (4 blocks): decodes never take a block there
    assert blocks.group_used_blocks() == [5, 4] and blocks.num_free_blocks == 31
    views = [step(s).chunks[0].kv_view for _ in range(5)]  # 4 decodes grow to 12 rows; the 5th evicts again
    assert [(v.rows_before[0], v.keep_after[0]) for v in views] == [(8, 9), (9, 10), (10, 11), (11, 12), (12, 8)]
    assert views[-1].tables == ((3, 4, 5, 8),) and blocks.group_used_blocks() == [7, 4]
    s.finish(s.running[0])
    assert blocks.num_free_blocks == 40 and blocks.group_used_blocks() == [0, 0]


def run_to_end(layout, num_blocks: int, num_seqs: int = 6, prompt: int = 40, outputs: int = 20) -> dict:
    """`num_seqs` requests of `prompt` + `outputs` tokens sharing `num_blocks` blocks (block_size 4, a
    step budget of 16 tokens), run to the end: steps taken, preemptions, the most sequences decoding
    (past their prompt) at once."""
    spec = KVSpec(block_size=4, num_blocks=num_blocks, bytes_per_block=100, kv_layout=layout)
    s = Scheduler(SchedulerConfig(8, 16), BlockManager(spec))
    for i in range(num_seqs):
        s.add(Sequence(i, list(range(100 * i, 100 * i + prompt)), GREEDY))
    steps = decoding = 0
    while s.has_work():
        step(s)
        steps += 1
        decoding = max(decoding, sum(1 for q in s.running if q.output_token_ids))
        for seq in [q for q in s.running if len(q.output_token_ids) >= outputs]:
            s.finish(seq)
    assert s.blocks.num_free_blocks == num_blocks and not s.too_long
    return {"steps": steps, "preemptions": s.num_preemptions, "decoding": decoding}


def test_admission_sees_what_eviction_freed():
    """The same bytes: 30 blocks of every layer, or 60 blocks of one of two layer groups. Once its
    prompt has ended a sequence's sparse group keeps 4 blocks (budget 8 + slack 4 + 1 rows), so more
    sequences decode at once, the whole load takes fewer steps, and none is preempted (admission keeps
    room for a prompt's peak)."""
    full = run_to_end(None, 30)
    layered = run_to_end(POLICY.layout(4, 1024), 60)
    assert layered["decoding"] > full["decoding"] and layered["steps"] < full["steps"], (full, layered)
    assert layered["preemptions"] == 0


def test_admission_keeps_room_for_the_whole_prompt_and_the_running_sequences():
    """A 40-token prompt prefilled 16 a step peaks at 10 blocks of group 0 and 10 of group 1 (no
    eviction within a prompt): beyond its first chunk's 4 + 4, 12 more must stay free, plus one a
    running sequence."""
    s, blocks = make(num_blocks=40)
    assert blocks.admission_reserve(0, 40, 16, 2) == 12 + 2
    chunked = KVPolicy("layered", full_layers=2, budget_tokens=8, window=2, sinks=2, evict_slack=4, prefill_evict=True)
    blocks = BlockManager(KVSpec(block_size=4, num_blocks=40, bytes_per_block=100, kv_layout=chunked.layout(4, 1024)))
    assert blocks.admission_reserve(0, 40, 16, 0) == (10 - 4) + (7 - 4)  # group 1 peaks at 8 + 4 + 16 rows
    blocks.allocate(0, 16)
    assert blocks.admission_reserve(0, 40, 16, 0) == 0  # it holds blocks: running, not admitted
    assert BlockManager(KVSpec(block_size=4, num_blocks=40, bytes_per_block=100)).admission_reserve(1, 40, 16, 3) == 0


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
    assert (blocks.advance(0, 9, 9) is None) == (not policy.is_layered)
