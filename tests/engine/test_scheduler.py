"""The scheduler's preemption order and the prefix cache's hash chain, on a pool small enough to run dry."""

from __future__ import annotations

from shoal.engine.core.kv_cache import BlockPool
from shoal.engine.core.outputs import RequestMetrics
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.core.sequence import Request, Sequence, SeqStatus
from shoal.engine.contracts import SamplingParams


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    request = Request(f"r{seq_id}", None, list(tokens), SamplingParams(), RequestMetrics(arrival_time=float(seq_id)))
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
