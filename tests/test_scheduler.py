"""Scheduler and block accounting, without a model."""
import pytest

from hetcore.backend import KVSpec, SamplingParams, StepOutput
from server.block_manager import BlockManager
from server.scheduler import Scheduler, SchedulerConfig, Sequence, SeqStatus

GREEDY = SamplingParams(temperature=0.0)


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, prefix_caching=False, shards=()):
    blocks = BlockManager(KVSpec(block_size=block_size, num_blocks=num_blocks, bytes_per_block=100, shards=shards))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, prefix_caching), blocks), blocks


def run_step(s: Scheduler, next_token=7):
    inp = s.schedule()
    out = StepOutput(sampled={c.seq_id: next_token for c in inp.chunks if c.sampling is not None})
    return inp, s.update(out)


def test_block_manager_exact_accounting():
    bm = BlockManager(KVSpec(block_size=4, num_blocks=5, bytes_per_block=100))
    assert bm.allocate(0, 5) == (0, 1)
    assert bm.allocate(1, 4) == (2,)
    assert bm.allocate(0, 8) == (0, 1)
    assert bm.allocate(0, 9) == (0, 1, 3)
    assert bm.used_bytes == 400 and bm.capacity_bytes == 500
    with pytest.raises(MemoryError):
        bm.allocate(1, 12)
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.used_bytes == 100
    bm.free(1)
    assert bm.used_bytes == 0


def test_a_sequence_past_reserve_from_holds_its_reserve_outside_its_table():
    """MagicPIG's first table set: blocks taken once a sequence has reserve_from tokens, never in its
    table (the store does not see them), freed with it, and counted by admission and preemption."""
    spec = KVSpec(block_size=4, num_blocks=12, bytes_per_block=100, reserve_blocks=3, reserve_from=8)
    assert [spec.blocks_for(n) for n in (7, 8, 9)] == [2, 5, 6]
    assert [spec.max_tokens(n) for n in (1, 2, 4, 5, 6)] == [4, 7, 7, 8, 12]
    bm = BlockManager(spec)
    assert bm.allocate(0, 7) == (0, 1) and bm.num_free_blocks == 10
    assert bm.num_missing(0, 8) == 3 and bm.allocate(0, 8) == (0, 1)  # the reserve, no new table block
    assert bm.num_free_blocks == 7 and bm.used_bytes == 500
    assert bm.allocate(0, 9) == (0, 1, 5) and bm.num_missing(0, 12) == 0
    assert bm.allocate(1, 12) == (6, 7, 8) and bm.num_free_blocks == 0  # 3 blocks of table and its reserve of 3
    bm.free(0)
    assert bm.num_free_blocks == 6 and sorted(bm._free[0]) == [0, 1, 2, 3, 4, 5]

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(spec))
    for i in range(3):
        s.add(Sequence(i, list(range(6)), GREEDY))
    run_step(s)  # three prompts of 6 tokens: 2 blocks each, no reserve yet
    assert s.blocks.num_free_blocks == 6
    run_step(s)  # each reaches 7 tokens
    inp, _ = run_step(s)  # 8 tokens: sequences 0 and 1 take their reserve (3 blocks each); 2 is preempted
    assert [c.seq_id for c in inp.chunks] == [0, 1] and s.num_preemptions == 1
    assert s.waiting[0].seq_id == 2 and s.blocks.num_free_blocks == 2


def test_prefill_is_chunked_under_the_token_budget_and_decodes_join():
    s, _ = make(budget=6)
    s.add(Sequence(0, list(range(10)), GREEDY))
    s.add(Sequence(1, [1, 2], GREEDY))
    inp, new = run_step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids), c.sampling) for c in inp.chunks] == [(0, 0, 6, None)]
    assert new == []
    inp, new = run_step(s)
    # seq 0 finishes its prompt (4 tokens) and samples; seq 1 is admitted with the remaining budget
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in inp.chunks] == [(0, 6, 4), (1, 0, 2)]
    assert [(q.seq_id, t) for q, t in new] == [(0, 7), (1, 7)]
    inp, _ = run_step(s)
    assert [(c.seq_id, c.start_pos, c.token_ids, c.output_index) for c in inp.chunks] == [(0, 10, (7,), 1), (1, 2, (7,), 1)]


def test_block_tables_cover_positions():
    s, _ = make(block_size=4)
    s.add(Sequence(0, list(range(9)), GREEDY))
    inp, _ = run_step(s)
    assert len(inp.chunks[0].block_table) == 3  # 9 tokens in blocks of 4


def test_preemption_frees_the_latest_and_recomputes_it():
    s, blocks = make(num_blocks=4, block_size=4, budget=64)
    s.add(Sequence(0, [1] * 7, GREEDY))  # 2 blocks
    s.add(Sequence(1, [2] * 7, GREEDY))  # 2 blocks
    run_step(s)
    assert blocks.num_free_blocks == 0
    run_step(s)  # both now hold 8 tokens: still 2 blocks each
    inp, new = run_step(s)  # seq 0 needs a third block: seq 1 (latest) is preempted
    assert s.num_preemptions == 1
    assert [c.seq_id for c in inp.chunks] == [0]
    assert inp.freed_seq_ids == (1,)
    s1 = s.waiting[0]
    assert s1.seq_id == 1 and s1.status is SeqStatus.WAITING and s1.num_computed == 0
    assert s1.output_token_ids == [7, 7]
    s.finish(s.running[0])
    inp, new = run_step(s)
    # recompute: prompt plus both generated tokens, then sample the third output
    assert inp.chunks[0].token_ids == (2,) * 7 + (7, 7)
    assert inp.chunks[0].output_index == 2
    s.finish(s1)
    assert blocks.used_bytes == 0


def test_sequence_larger_than_the_store_is_reported_not_looped():
    s, blocks = make(num_blocks=2, block_size=4, budget=64)
    s.add(Sequence(0, [1] * 12, GREEDY))
    inp = s.schedule()
    assert inp.chunks == () and [q.seq_id for q in s.too_long] == [0]
    s.too_long.clear()
    s.add(Sequence(1, [1] * 7, GREEDY))
    for _ in range(3):
        run_step(s)
    assert [q.seq_id for q in s.too_long] == [1] and blocks.used_bytes == 0 and not s.running


def test_max_num_seqs_limits_admission():
    s, _ = make(max_num_seqs=2)
    for i in range(3):
        s.add(Sequence(i, [1, 2], GREEDY))
    inp, _ = run_step(s)
    assert [c.seq_id for c in inp.chunks] == [0, 1] and len(s.waiting) == 1


def test_sharded_blocks_spread_sequences_and_skip_dead_shards():
    from hetcore.backend import KVSpec
    from server.block_manager import BlockManager

    blocks = BlockManager(KVSpec(block_size=4, num_blocks=10, bytes_per_block=1, shards=(5, 5)))
    tables = [blocks.allocate(s, 6) for s in range(3)]  # 2 blocks each
    assert [blocks.shard_of(s) for s in range(3)] == [0, 1, 0]
    assert tables[1] == (5, 6) and blocks.allocate(1, 20) == (5, 6, 7, 8, 9)  # grows inside its shard
    assert not blocks.can_hold(1, 24) and blocks.can_hold(0, 12)
    assert blocks.max_seq_blocks == 5 and blocks.num_free_blocks == 1
    blocks.free(1)
    blocks.live.discard(1)
    assert blocks.num_free_blocks == 1 and not blocks.can_hold(3, 8)  # shard 1 is down: only shard 0 counts
    blocks.live.add(1)
    assert blocks.can_hold(3, 20) and blocks.allocate(3, 20) == (5, 6, 7, 8, 9)


def test_prefix_cache_shares_full_blocks_and_computes_the_rest():
    s, blocks = make(num_blocks=32, prefix_caching=True)
    s.add(Sequence(0, list(range(10)), GREEDY))
    run_step(s)  # 10 tokens: blocks 0 and 1 are full and registered
    s.add(Sequence(1, list(range(8)) + [50, 51, 52], GREEDY))
    s.add(Sequence(2, [9] + list(range(1, 11)), GREEDY))  # differs in its first token: nothing to share
    inp, _ = run_step(s)
    one, two = inp.chunks[1:]
    assert (one.start_pos, one.token_ids) == (8, (50, 51, 52)) and one.block_table[:2] == inp.chunks[0].block_table[:2]
    assert (two.start_pos, len(two.token_ids)) == (0, 11) and not set(two.block_table) & set(one.block_table)
    seqs = {q.seq_id: q for q in s.running}
    assert [seqs[i].num_cached_tokens for i in range(3)] == [0, 8, 0]
    assert (blocks.queried_tokens, blocks.hit_tokens) == (10 + 11 + 11, 8)
    # block keys name every token before a block's end, not only its own
    assert Sequence(3, [1, 2, 3, 4, 5, 6, 7, 8], GREEDY).block_keys(2, 4)[1] != \
        Sequence(4, [0, 2, 3, 4, 5, 6, 7, 8], GREEDY).block_keys(2, 4)[1]


def test_prefix_cache_shares_within_one_step_but_computes_the_last_token():
    """n choices arrive together: the later ones take the blocks the first fills in the same step (the
    workers write a layer's KV before any of its attention reads). A prompt of whole blocks still
    computes its last block, whose last row's logits give the first token."""
    s, blocks = make(num_blocks=32, prefix_caching=True, budget=32)
    for i in range(3):
        s.add(Sequence(i, list(range(12)), GREEDY))
    inp, _ = run_step(s)
    assert [(c.start_pos, len(c.token_ids)) for c in inp.chunks] == [(0, 12), (8, 4), (8, 4)]
    assert len({c.block_table[:2] for c in inp.chunks}) == 1 and len({c.block_table[2] for c in inp.chunks}) == 3
    assert blocks.num_free_blocks == 32 - 3 - 2


def test_prefix_cache_keeps_idle_blocks_until_space_is_needed():
    s, blocks = make(num_blocks=8, prefix_caching=True, budget=32)
    s.add(Sequence(0, list(range(9)), GREEDY))
    run_step(s)
    first = s.running[0]
    table = blocks.table(0)
    s.finish(first)
    assert blocks.num_free_blocks == 8 and blocks.used_bytes == 0  # its two full blocks idle, still cached
    s.add(Sequence(1, list(range(9)) + [3], GREEDY))
    inp, _ = run_step(s)
    assert inp.chunks[0].start_pos == 8 and inp.chunks[0].block_table[:2] == table[:2]
    s.finish(s.running[0])
    # 8 blocks wanted: the 5 free ones go first, then the idle ones, least recently used first
    s.add(Sequence(2, [7] * 29, GREEDY))
    inp, _ = run_step(s)
    assert len(inp.chunks[0].block_table) == 8 and blocks.num_free_blocks == 0
    s.finish(s.running[0])
    s.add(Sequence(3, list(range(9)), GREEDY))
    assert run_step(s)[0].chunks[0].start_pos == 0  # evicted


def test_prefix_cache_forgets_the_blocks_of_a_failed_step_and_of_a_lost_shard():
    s, blocks = make(num_blocks=16, prefix_caching=True, shards=(8, 8))
    s.add(Sequence(0, list(range(9)), GREEDY))
    s.schedule()  # the step fails: its blocks may not hold their KV
    blocks.forget_uncommitted()
    s.preempt_all()
    s.add(Sequence(1, list(range(9)), GREEDY))
    inp, _ = run_step(s)
    assert [c.start_pos for c in inp.chunks] == [0, 8]  # 0 computes its blocks again, 1 shares them
    shard = blocks.shard_of(0)
    assert blocks.shard_of(1) == shard
    s.add(Sequence(2, list(range(9)), GREEDY))
    inp, _ = run_step(s)
    assert inp.chunks[-1].start_pos == 8 and blocks.shard_of(2) == shard  # placed where its prefix is
    s.preempt_all()
    blocks.set_live({1 - shard})  # that worker died: its store is gone
    blocks.set_live({0, 1})
    assert blocks.num_free_blocks == 16
    assert [c.start_pos for c in s.schedule().chunks] == [0, 8, 8]  # the first computes them again


def test_prefix_cache_is_not_used_by_prompts_to_score_or_when_off():
    s, _ = make(num_blocks=32, prefix_caching=True)
    s.add(Sequence(0, list(range(9)), GREEDY))
    run_step(s)
    s.add(Sequence(1, list(range(9)), SamplingParams(temperature=0.0, prompt_logprobs=0)))
    assert run_step(s)[0].chunks[1].start_pos == 0
    s, blocks = make(num_blocks=32)
    s.add(Sequence(0, list(range(9)), GREEDY))
    run_step(s)
    s.add(Sequence(1, list(range(9)), GREEDY))
    assert run_step(s)[0].chunks[1].start_pos == 0 and blocks.queried_tokens == 0


def test_a_preempted_sequence_recomputes_from_its_cached_blocks():
    s, _ = make(num_blocks=5, prefix_caching=True, budget=32)
    s.add(Sequence(0, list(range(8)), GREEDY))
    s.add(Sequence(1, list(range(20, 28)), GREEDY))
    run_step(s)  # 2 + 2 blocks, all full and registered
    for _ in range(4):
        run_step(s)  # at 9 tokens both need a third block and one is free: sequence 1 is preempted
    assert s.num_preemptions == 1 and s.waiting[0].seq_id == 1
    s.finish(s.running[0])
    inp, _ = run_step(s)
    assert inp.chunks[0].start_pos == 8  # its prompt's two blocks, still cached


def test_prefix_cache_evicts_a_prefix_from_its_end():
    """Idle cached blocks go least recently used first, and a freed sequence's last block before its first:
    a run of blocks is found from its start, so its start is worth the most."""
    bm = BlockManager(KVSpec(block_size=4, num_blocks=4, bytes_per_block=1))
    keys = [b"k0", b"k1", b"k2"]
    table = bm.allocate(0, 12)
    bm.register(0, keys)
    bm.commit()
    bm.free(0)
    assert bm.num_free_blocks == 4 and bm.allocate(1, 8) == (3, table[2])  # the free block, then the last one
    assert bm.share_prefix(2, keys) == 2 and bm.table(2) == table[:2]
    bm.free(2)
    bm.free(1)
    bm.forget_uncommitted()  # nothing pending: a no-op
    assert bm.share_prefix(3, keys) == 2


def test_a_shared_prefix_holds_blocks_for_its_own_state():
    """With MagicPIG each sequence keeps its own hash-table codes of every token, shared blocks too
    (KVSpec.own_share): sharing n blocks holds ceil(n * share) more, and none when they do not fit."""
    spec = KVSpec(block_size=4, num_blocks=10, bytes_per_block=1, own_share=0.5)
    bm = BlockManager(spec)
    keys = [b"k0", b"k1", b"k2"]
    bm.allocate(0, 12)
    bm.register(0, keys)
    bm.commit()
    assert bm.share_prefix(1, keys) == 3 and bm.num_free_blocks == 10 - 3 - 2  # its 3 shared blocks' own 2
    assert bm.used_bytes == 5
    bm.free(0)
    assert bm.num_free_blocks == 10 - 3 - 2  # the shared blocks stay held by sequence 1
    bm.free(1)
    assert bm.num_free_blocks == 10 and bm.used_bytes == 0
    bm.allocate(2, 24)  # 6 of the 7 other blocks: 1 free and 3 idle cached left
    assert bm.share_prefix(3, keys) == 0 and bm.table(3) == ()  # its 2 own blocks would have to evict its prefix
    assert bm.share_prefix(3, keys[:1]) == 1 and bm.num_free_blocks == 2  # 1 shared, 1 own
