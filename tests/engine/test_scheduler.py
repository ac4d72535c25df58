"""The scheduler's preemption order and the prefix cache's hash chain, on a pool small enough to run dry."""

from __future__ import annotations

from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.outputs import RequestMetrics
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.sequence import Request, Sequence, SeqStatus
from shoal.engine.contracts import SamplingParams


def _seq(seq_id: int, tokens: list[int], priority: int = 0) -> Sequence:
    request = Request(f"r{seq_id}", None, list(tokens), SamplingParams(), RequestMetrics(arrival_time=float(seq_id)),
                      priority)
    seq = Sequence(seq_id, request, 0, list(tokens), len(tokens))
    request.seqs.append(seq)
    return seq


def _step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.after_step(out)
    for s in out.scheduled:  # every sequence that finished its prompt "samples" one token
        if s.samples:
            s.seq.token_ids.append(7)
    return out


def test_a_dry_pool_preempts_the_newest_running_sequence_never_a_scheduled_one():
    pool = BlockPool(num_blocks=6, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(i, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4]) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    _step(scheduler)  # 3 prompts of 4 tokens: 6 blocks, the pool is full
    assert pool.num_free == 0 and [s.status for s in seqs] == [SeqStatus.RUNNING] * 3

    seqs[0].token_ids += [7, 7, 7, 7]  # the oldest needs three more blocks: the newest two give theirs up in turn
    out = _step(scheduler)
    assert [s.seq for s in out.scheduled] == [seqs[0]]
    assert out.preempted == [seqs[2], seqs[1]]
    assert list(scheduler.waiting) == [seqs[1], seqs[2]]  # first arrived first, ahead of anything newer


def test_a_sequence_preempts_itself_when_it_is_the_last_one_left_and_nothing_is_scheduled_after_it():
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(i, [1, 2, 3, 4]) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    _step(scheduler)
    seqs[0].token_ids += [7, 7, 7, 7]  # three more blocks: more than preempting seqs[1] frees
    out = _step(scheduler)
    assert out.scheduled == [] and out.preempted == [seqs[1], seqs[0]]
    assert scheduler.running == [] and pool.num_free == 4


def test_priority_lets_an_arrival_go_before_the_remaining_prefill_of_lower_priority_prompts():
    pool = BlockPool(num_blocks=64, block_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=8, policy="priority")
    longs = [_seq(i, list(range(1, 25)), priority=5) for i in range(2)]  # 24-token prompts: 3 steps each
    background = _seq(2, [1, 2], priority=9)
    for seq in (background, *longs):
        scheduler.add(seq)
    _step(scheduler)  # the lowest priority value first: the long prompts' first chunk
    _step(scheduler)
    assert [s.num_computed_tokens for s in longs] == [16, 0] and background.status is SeqStatus.WAITING
    short = _seq(3, [5, 6, 7], priority=1)
    scheduler.add(short)
    out = _step(scheduler)
    # the arrival's whole prompt first, then what is left of the budget to the deferred prefill
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(short, 3), (longs[0], 5)]
    out = _step(scheduler)
    assert out.scheduled[0].seq is short and out.scheduled[0].num_new_tokens == 1  # its decode, every step
    # fcfs: the running prompt keeps the budget
    fcfs = Scheduler(BlockPool(num_blocks=64, block_size=2, enable_prefix_caching=False), max_num_seqs=8,
                     max_num_batched_tokens=8)
    first = _seq(0, list(range(1, 25)), priority=5)
    fcfs.add(first)
    _step(fcfs)
    fcfs.add(_seq(1, [5, 6, 7], priority=0))
    assert [s.seq for s in _step(fcfs).scheduled] == [first]


def test_published_blocks_are_found_by_a_later_prompt_with_the_same_prefix():
    pool = BlockPool(num_blocks=16, block_size=2)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=3)  # chunked: 3 tokens per step
    first = _seq(0, [1, 2, 3, 4, 5, 6, 7])
    scheduler.add(first)
    while first.num_computed_tokens < first.num_prompt_tokens:
        _step(scheduler)
    assert len(first.block_hashes) == 3  # the prompt's three full blocks, published step by step
    ids, hashes = pool.lookup_prefix([1, 2, 3, 4, 9, 9, 9], max_tokens=6)
    assert ids == first.block_ids[:2] and hashes == first.block_hashes[:2]
    pool.free(ids)


# ------------------------------------------------------------------------------------------------- sliding window


def _held(scheduler: Scheduler) -> dict[int, int]:
    held: dict[int, int] = {}
    for seq in list(scheduler.running) + list(scheduler.waiting):
        for b in seq.held_block_ids:
            held[b] = held.get(b, 0) + 1
    return held


def _check_window_invariants(scheduler: Scheduler, window: int) -> None:
    """Every referenced block is held by exactly its ref count's sequences (no leak, no double reference); a
    sequence holds every block its next query can see and none wholly before its window; freed entries are 0."""
    pool, bs = scheduler.pool, scheduler.block_size
    assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == _held(scheduler)
    assert pool.num_free == pool.num_blocks - len(_held(scheduler))
    for seq in scheduler.running:
        first_visible = max(0, seq.num_computed_tokens - window + 1)
        assert seq.num_freed_blocks == min(first_visible // bs, len(seq.block_ids))
        assert seq.block_ids[:seq.num_freed_blocks] == [0] * seq.num_freed_blocks
        assert all(pool.blocks[b].ref_count > 0 for b in seq.held_block_ids)


def test_sliding_window_frees_blocks_that_no_query_can_see_again():
    window, bs = 5, 2
    pool = BlockPool(num_blocks=12, block_size=bs, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=3, sliding_window=window)
    seqs = [_seq(i, list(range(10 * i + 1, 10 * i + 10))) for i in range(2)]  # 9-token prompts, chunked by 3
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(40):  # the prompts, then decodes far past the window: 2 x 25 tokens in a 24-token pool
        _step(scheduler)
        _check_window_invariants(scheduler, window)
        assert all(len(s.held_block_ids) <= (window - 1) // bs + 2 for s in scheduler.running)
    assert scheduler.num_preemptions == 0  # without freeing, 2 x 25 tokens would not fit in 12 blocks of 2
    assert all(s.num_tokens > 24 and s.num_freed_blocks > 5 for s in seqs)
    for seq in seqs:
        scheduler.remove(seq)
    pool.check_all_free()


def test_sliding_window_with_prefix_caching_and_preemption_stays_consistent():
    """Freed blocks keep their hash in the free queue: a new request with the same prompt may take them back as a
    cached prefix (their content is still that prefix's), and once one is handed out again its hash is gone, so it
    is never served as a stale prefix."""
    window, bs = 4, 2
    pool = BlockPool(num_blocks=8, block_size=bs)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=4, sliding_window=window)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    first = _seq(0, list(prompt))
    scheduler.add(first)
    for _ in range(5):
        _step(scheduler)
        _check_window_invariants(scheduler, window)
    assert first.num_freed_blocks >= 3
    freed_hashes = first.block_hashes[:first.num_freed_blocks]
    assert all(pool._cached.get(h) is not None for h in freed_hashes)  # published before they slid out

    again = _seq(1, list(prompt))
    scheduler.add(again)
    _step(scheduler)
    assert again.num_cached_tokens >= 3 * bs  # the freed-but-cached leading blocks served the new prompt
    _check_window_invariants(scheduler, window)

    # A third request with another prompt: the pool runs dry, blocks are evicted and reused, sequences are
    # preempted (with some blocks already freed by the window) and resumed.
    other = _seq(3, [50 + t for t in range(9)])
    scheduler.add(other)
    for _ in range(30):
        _step(scheduler)
        _check_window_invariants(scheduler, window)
        for block_hash, block_id in pool._cached.items():  # a cached hash always names its block's content
            assert pool.blocks[block_id].block_hash == block_hash
    third = _seq(2, list(prompt))
    scheduler.add(third)
    for _ in range(6):
        _step(scheduler)
        _check_window_invariants(scheduler, window)
    for seq in (first, again, other, third):
        scheduler.remove(seq)
    pool.check_all_free()


def test_preempting_a_sequence_whose_window_freed_blocks_frees_only_the_rest():
    window, bs = 6, 2  # a decoding sequence holds 3 to 4 blocks: two of them do not always fit in 6
    pool = BlockPool(num_blocks=6, block_size=bs, enable_prefix_caching=False)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16, sliding_window=window)
    seqs = [_seq(i, [10 * i + 1, 10 * i + 2, 10 * i + 3]) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(30):
        _step(scheduler)
        _check_window_invariants(scheduler, window)
    assert scheduler.num_preemptions > 0 and any(s.num_tokens > 12 for s in seqs)
    for seq in seqs:
        scheduler.remove(seq)
    pool.check_all_free()


def test_a_double_free_is_caught():
    pool = BlockPool(num_blocks=2, block_size=2)
    ids = pool.allocate(1)
    pool.free(ids)
    import pytest

    with pytest.raises(AssertionError, match="freed while unreferenced"):
        pool.free(ids)
