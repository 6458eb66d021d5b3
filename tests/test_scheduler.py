"""Scheduler driven by a fake model: token budget, chunked prefill, preemption, stops, caching."""

from __future__ import annotations

import random

import pytest

from neuron_runtime.config import SchedulerConfig
from neuron_runtime.kv_cache import KVCacheManager
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.scheduler import Scheduler, SchedulerOutput

BS = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunked: bool = True,
    caching: bool = True,
    max_model_len: int = 1000,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
    )
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(config, kv, max_model_len)


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id=EOS)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake model that samples ``token`` for every sampling slice."""
    out = sched.schedule()
    sched.update(out, {s.req_id: token for s in out.seqs if s.sample}, {})
    return out


def slices(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.req_id, s.start_pos, len(s.token_ids), s.sample) for s in out.seqs]


def all_free(sched: Scheduler) -> bool:
    pool = sched.kv.pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


class FakeModel:
    """Writes each scheduled token into a fake paged cache and reads the whole context back.

    Reading every position through the block table checks that block tables, prefix-cache hits
    and preemption never hand a request KV that is not its own.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.cache: dict[tuple[int, int], int] = {}  # (block_id, slot) -> token

    def run(self, out: SchedulerOutput, token_fn) -> dict[str, int]:
        sampled = {}
        for seq in out.seqs:
            request = self.sched.requests[seq.req_id]
            assert seq.start_pos == request.num_computed_tokens
            end = seq.start_pos + len(seq.token_ids)
            assert seq.token_ids == request.all_token_ids[seq.start_pos : end]
            assert seq.sample == (end == request.num_tokens)
            assert len(seq.block_table) >= -(-end // BS)
            for pos, tok in enumerate(seq.token_ids, start=seq.start_pos):
                self.cache[(seq.block_table[pos // BS], pos % BS)] = tok
            context = [self.cache.get((seq.block_table[p // BS], p % BS)) for p in range(end)]
            assert context == request.all_token_ids[:end], f"wrong KV for {seq.req_id}"
            if seq.sample:
                sampled[seq.req_id] = token_fn(request)
        return sampled


# Budget and slots


def test_single_request_prefill_then_decode_then_length_stop():
    sched = make_scheduler()
    req = make_request("a", list(range(10, 20)), max_tokens=3)
    sched.add_request(req)
    out = step(sched)
    assert slices(out) == [("a", 0, 10, True)]
    assert out.num_batched_tokens == 10
    assert len(out.seqs[0].block_table) == 3
    assert slices(step(sched)) == [("a", 10, 1, True)]
    assert slices(step(sched)) == [("a", 11, 1, True)]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.finish_reason == "length"
    assert req.output_token_ids == [7, 7, 7]
    assert not sched.has_unfinished()
    assert all_free(sched)


def test_token_budget_with_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=16)
    for i, name in enumerate("abc"):
        sched.add_request(make_request(name, [10 + i] * 10, max_tokens=5))
    out = step(sched)
    assert slices(out) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert out.num_batched_tokens == 16
    out = step(sched)
    # Running first: a decodes, b finishes its prompt, c gets what is left.
    assert slices(out) == [("a", 10, 1, True), ("b", 6, 4, True), ("c", 0, 10, True)]
    assert out.num_batched_tokens == 15


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", [5, 6, 7], max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    assert [s.req_id for s in step(sched).seqs] == ["r0", "r1"]
    assert [s.req_id for s in step(sched).seqs] == ["r0", "r1"]  # both finish here
    assert slices(step(sched)) == [("r2", 0, 3, True)]


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 123))  # 23 tokens
    req = make_request("a", prompt, max_tokens=2)
    sched.add_request(req)
    outs = [step(sched) for _ in range(3)]
    assert [slices(o) for o in outs] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 7, True)],
    ]
    assert sum((o.seqs[0].token_ids for o in outs), []) == prompt
    assert req.output_token_ids == [7]  # nothing sampled before the last chunk
    assert slices(step(sched)) == [("a", 23, 1, True)]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched = make_scheduler(max_num_batched_tokens=16, chunked=False)
    sched.add_request(make_request("a", [1] * 10, max_tokens=5))
    sched.add_request(make_request("b", [2] * 10, max_tokens=5))
    sched.add_request(make_request("c", [3] * 2, max_tokens=5))
    out = step(sched)
    # b needs 10 > 6 left and waits; c queues behind it (first come, first served).
    assert slices(out) == [("a", 0, 10, True)]
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert sched.requests["b"].block_table == []
    assert slices(step(sched)) == [("a", 10, 1, True), ("b", 0, 10, True), ("c", 0, 2, True)]


def test_running_requests_are_scheduled_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("old", [1] * 20, max_tokens=2))
    step(sched)
    sched.add_request(make_request("new", [2] * 3, max_tokens=2))
    out = step(sched)
    # old's remaining prompt takes the whole budget; new gets nothing this step.
    assert slices(out) == [("old", 8, 8, False)]
    out = step(sched)
    assert slices(out) == [("old", 16, 4, True), ("new", 0, 3, True)]


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="'a'"):
        sched.add_request(make_request("a", [2]))


# Preemption


def test_newest_running_request_is_preempted_and_resumes():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    a = make_request("a", [10, 11, 12, 13, 14, 15, 16], max_tokens=9)
    b = make_request("b", [20, 21, 22, 23, 24, 25, 26], max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)

    def model_step(token: int) -> SchedulerOutput:
        out = sched.schedule()
        sched.update(out, model.run(out, lambda r: token), {})
        return out

    model_step(30)  # prefill both: 2 blocks each, pool full
    model_step(31)  # decode at position 7: still 2 blocks each
    sched.add_request(make_request("c", [40, 41, 42], max_tokens=1))
    out = model_step(32)  # a needs a third block: b, the newest, makes room
    assert out.preempted_req_ids == ["b"]
    assert slices(out) == [("a", 8, 1, True)]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert b.num_computed_tokens == 0
    assert b.block_table == []
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert b.output_token_ids == [30, 31]

    resumed = None
    for _ in range(30):
        if not sched.has_unfinished():
            break
        out = model_step(33)
        resumed = resumed or next((s for s in out.seqs if s.req_id == "b"), None)
    assert not sched.has_unfinished()
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [30, 31, 32] + [33] * 6
    assert b.output_token_ids == [30, 31] + [33] * 7
    # b restarts from its prompt plus what it had produced; a grew into both of b's freed
    # blocks before b came back, so nothing of b stayed cached.
    assert resumed.start_pos == 0
    assert resumed.token_ids == [20, 21, 22, 23, 24, 25, 26, 30, 31]
    assert all_free(sched)


def test_preempted_request_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", [10, 11, 12, 13, 14, 15, 16], max_tokens=3)
    b = make_request("b", [20, 21, 22, 23, 24, 25, 26], max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    out = step(sched)  # a takes b's tail block and finishes; b's first block stays cached
    assert out.preempted_req_ids == ["b"]
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = step(sched)
    assert slices(out) == [("b", 4, 5, True)]
    assert out.seqs[0].token_ids == [24, 25, 26, 7, 7]
    assert b.num_cached_tokens == 4
    step(sched)
    assert b.output_token_ids == [7, 7, 7]
    assert all_free(sched)


def test_preempted_request_does_not_hold_blocks_while_waiting():
    # Regression: a waiting request whose prefix hit could not be admitted kept the hit blocks,
    # so two preempted requests pinned the whole pool and the engine stopped making progress.
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", list(range(10, 17)), max_tokens=9)
    b = make_request("b", list(range(20, 27)), max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out = step(sched)
        assert not out.empty, "no progress"
        held = {bid for r in sched.waiting for bid in r.block_table}
        assert not held
    assert a.num_output_tokens == b.num_output_tokens == 9
    assert all_free(sched)


def test_request_preempting_itself_when_alone():
    sched = make_scheduler(num_blocks=2, max_model_len=1000)
    a = make_request("a", [1] * 8, max_tokens=5)
    sched.add_request(a)
    step(sched)  # 8 prompt tokens fill both blocks; token 9 needs a third one
    out = sched.schedule()
    assert out.preempted_req_ids == ["a"]
    assert out.empty
    assert a.status == RequestStatus.PREEMPTED and a.block_table == []
    assert all_free(sched)


# Finish, abort, failure


@pytest.mark.parametrize("where", ["waiting", "running", "partial"])
def test_abort_frees_every_block(where):
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", list(range(1, 14)), max_tokens=4)
    sched.add_request(a)
    if where == "running":
        step(sched)
        step(sched)
    elif where == "partial":
        step(sched)  # 8 of 13 prompt tokens
        assert a.status == RequestStatus.RUNNING and a.output_token_ids == []
    finished = sched.finish("a", RequestStatus.FINISHED_ABORTED)
    assert finished is a
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort"
    assert a.block_table == []
    assert not sched.has_unfinished()
    assert "a" not in sched.requests
    assert all_free(sched)
    assert sched.finish("a", RequestStatus.FINISHED_ABORTED) is None


def test_abort_while_the_step_ran_is_ignored_by_update():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", [4, 5, 6], max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    updated = sched.update(out, {"a": 9, "b": 9}, {})
    assert updated == [b]
    assert a.output_token_ids == []
    assert b.output_token_ids == [9]
    assert [s.req_id for s in sched.schedule().seqs] == ["b"]


def test_failed_row_ends_the_request_with_an_error():
    sched = make_scheduler()
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=4)
    b = make_request("b", [6, 7, 8], max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    updated = sched.update(out, {"b": 9}, {"a": "nan in logits"})
    assert updated == [a, b]
    assert a.status == RequestStatus.FINISHED_ERROR
    assert a.finish_reason == "error"
    assert a.error == "nan in logits"
    assert a.block_table == []
    assert [r.req_id for r in sched.running] == ["b"]
    step(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert all_free(sched)


# Stop rules


def run_to_end(sched: Scheduler, tokens: list[int]) -> None:
    """Feeds tokens[i] as the i-th sampled token of every request."""
    for _ in range(100):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        sampled = {
            s.req_id: tokens[sched.requests[s.req_id].num_output_tokens]
            for s in out.seqs
            if s.sample
        }
        sched.update(out, sampled, {})
    raise AssertionError("did not finish")


def test_stop_on_eos():
    sched = make_scheduler()
    req = make_request("a", [1, 3], ignore_eos=False, max_tokens=10)
    sched.add_request(req)
    run_to_end(sched, [5, 6, EOS, 8, 8, 8])
    assert req.output_token_ids == [5, 6, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.finish_reason == "stop"
    assert req.stop_reason is None
    assert all_free(sched)


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    req = make_request("a", [1, 3], ignore_eos=True, max_tokens=4)
    sched.add_request(req)
    run_to_end(sched, [EOS] * 10)
    assert req.output_token_ids == [EOS] * 4
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids():
    sched = make_scheduler()
    req = make_request("a", [1, 3], stop_token_ids=[42, 43], max_tokens=10)
    sched.add_request(req)
    run_to_end(sched, [5, 43, 42, 8, 8, 8])
    assert req.output_token_ids == [5, 43]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 43


def test_min_tokens_delays_eos_and_stop_tokens():
    sched = make_scheduler()
    req = make_request("a", [1, 3], ignore_eos=False, min_tokens=3, max_tokens=10)
    sched.add_request(req)
    run_to_end(sched, [EOS, EOS, EOS, EOS])
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED

    sched = make_scheduler()
    req = make_request("b", [1, 3], stop_token_ids=[42], min_tokens=2, max_tokens=10)
    sched.add_request(req)
    run_to_end(sched, [42, 42, 42])
    assert req.output_token_ids == [42, 42]
    assert req.stop_reason == 42


def test_max_model_len_stops_with_length():
    sched = make_scheduler(max_model_len=7)
    req = make_request("a", [1, 2, 3, 4, 5], max_tokens=None)
    sched.add_request(req)
    run_to_end(sched, [9] * 10)
    assert req.num_tokens == 7
    assert req.output_token_ids == [9, 9]
    assert req.status == RequestStatus.FINISHED_LENGTH


# Prefix caching


def test_second_request_starts_at_the_cached_prefix():
    sched = make_scheduler()
    shared = list(range(50, 60))  # 10 tokens: 2 full blocks
    a = make_request("a", [*shared, 1], max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.status.finished
    b = make_request("b", [*shared, 2, 3], max_tokens=1)
    sched.add_request(b)
    out = step(sched)
    assert slices(out) == [("b", 8, 4, True)]
    assert b.num_cached_tokens == 8
    assert sched.kv.prefix_cache_hits == 8
    assert all_free(sched)


def test_prefix_shared_with_a_running_request():
    sched = make_scheduler()
    shared = [9] * 8
    a = make_request("a", [*shared, 1, 1], max_tokens=5)
    sched.add_request(a)
    step(sched)
    b = make_request("b", [*shared, 2], max_tokens=5)
    sched.add_request(b)
    out = step(sched)
    assert slices(out) == [("a", 10, 1, True), ("b", 8, 1, True)]
    assert b.block_table[:2] == a.block_table[:2]
    run_to_end(sched, [7] * 10)
    assert all_free(sched)


def test_no_prefix_hits_when_caching_is_disabled():
    sched = make_scheduler(caching=False)
    shared = list(range(50, 60))
    sched.add_request(make_request("a", [*shared, 1], max_tokens=1))
    step(sched)
    b = make_request("b", [*shared, 2], max_tokens=1)
    sched.add_request(b)
    assert slices(step(sched)) == [("b", 0, 11, True)]
    assert b.num_cached_tokens == 0


# Randomized workload


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_invariants(seed, chunked):
    rng = random.Random(seed)
    budget = 32  # every request fits in one step, so none waits forever without chunking
    sched = make_scheduler(
        num_blocks=rng.choice([12, 20, 40]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=budget,
        chunked=chunked,
        caching=rng.random() < 0.7,
    )
    model = FakeModel(sched)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    expected_len: dict[str, int] = {}
    all_reqs: list[Request] = []
    for i in range(16):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 10))]
        req = make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8))
        expected_len[req.req_id] = req.max_tokens
        all_reqs.append(req)
    pending = list(all_reqs)
    aborted = set()
    for _ in range(500):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        if sched.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.requests))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        out = sched.schedule()
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.seqs) <= budget
        assert len(out.seqs) <= sched.config.max_num_seqs
        assert len(sched.running) <= sched.config.max_num_seqs
        assert len({s.req_id for s in out.seqs}) == len(out.seqs)
        sampled = model.run(out, lambda r: rng.randrange(3, 50))
        sched.update(out, sampled, {})
        # Only running requests own blocks, and ref counts match the block tables.
        refs = [0] * sched.kv.pool.num_blocks
        for r in sched.running:
            for bid in r.block_table:
                refs[bid] += 1
        for r in sched.waiting:
            assert r.block_table == []
        assert refs == [b.ref_count for b in sched.kv.pool.blocks]
    assert not pending and not sched.has_unfinished()
    for req in all_reqs:
        if req.req_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert req.num_output_tokens == expected_len[req.req_id]
    assert all_free(sched)
