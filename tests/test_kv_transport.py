"""The NIXL KV transport without Serve: a prefill-side and a decode-side transport (two NIXL
agents over UCX) attached to two engines in one process, as two replicas would be.

The reference is one engine generating the whole request; the decode engine's cache blocks
are also compared with the prefill engine's, byte for byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import time

import numpy as np
import pytest
import torch

from deployments.kv_transport import KVTransportConfig, KVTransportError, make_transport
from deployments.nixl_transport import (
    NOTIFY_POLL_MAX_S,
    NOTIFY_POLL_MIN_S,
    NOTIFY_POLL_SHARE,
    NixlAgentInfo,
    NixlBlockRead,
    NixlTicket,
    NixlTransport,
)
from neuron_runtime import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.kv_layout import HUGE_PAGE_BYTES, KVLayout, read_descriptors, use_huge_pages
from neuron_runtime.kv_transfer import KVHandoff, KVPayload

MAX_MODEL_LEN = 512


class Published:
    """An awaitable holding an agent's info: what ``ray.put``'s ref is to a real replica."""

    def __init__(self, info: NixlAgentInfo) -> None:
        self.info = info

    def __await__(self):  # noqa: ANN204
        return self._get().__await__()

    async def _get(self) -> NixlAgentInfo:
        return self.info


class Missing:
    """The ref of an agent whose replica died before anyone loaded it."""

    def __await__(self):  # noqa: ANN204
        return self._get().__await__()

    async def _get(self) -> NixlAgentInfo:
        raise RuntimeError("the owner of this object died")


def engine(path, **overrides) -> LLMEngine:  # noqa: ANN001
    args = dict(model=str(path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=96)
    args.update(overrides)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run_all(eng: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, dict]]) -> dict:
    for request_id, prompt, params, kwargs in requests:
        eng.add_request(
            request_id, {"prompt_token_ids": prompt}, params, RequestOutputKind.FINAL_ONLY, **kwargs
        )
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def prompts(count: int, base: int = 3, step: int = 37) -> list[list[int]]:
    return [[5 + (7 * i + j) % 300 for j in range(base + step * i)] for i in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> LLMEngine:
    return engine(tiny_llama_path)


@pytest.fixture
def pair(tiny_llama_path, request):
    """(prefill engine, its transport, decode engine, its transport); the decode engine's
    block size is ``request.param`` (16 unless parametrized)."""
    block_size = getattr(request, "param", 16)
    prefill = engine(tiny_llama_path, num_kv_blocks=64)
    decode = engine(tiny_llama_path, block_size=block_size, num_kv_blocks=192)
    sender = NixlTransport(hold_timeout_s=5.0, publish=Published)
    sender.attach(prefill, prefill.release_kv)
    receiver = NixlTransport(publish=Published)
    receiver.attach(decode, decode.abort_request)
    yield prefill, sender, decode, receiver
    sender.close()
    receiver.close()


def assert_idle(eng: LLMEngine) -> None:
    stats = eng.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_used == stats.num_kv_blocks_held == stats.num_kv_reads == 0


async def wait_released(prefill: LLMEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while prefill.stats().num_kv_blocks_held:
        assert time.monotonic() < deadline, prefill.stats()
        await asyncio.sleep(0.01)


async def drain(decode: LLMEngine) -> dict:
    """Steps the decode engine until every request ended; their final outputs by id."""
    final = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out
        await asyncio.sleep(0)  # lets the prefill side see its notifications
    return final


async def hand_over(pair, token_lists, params, policy_fail: bool = False) -> tuple[dict, list]:  # noqa: ANN001
    """Prefill -> export -> receive -> decode for each prompt; the decode outputs and what
    each receive returned."""
    prefill, sender, decode, receiver = pair
    pre = run_all(
        prefill,
        [
            (f"p{i}", p, sp, {"export_kv": True})
            for i, (p, sp) in enumerate(zip(token_lists, params, strict=True))
        ],
    )
    requests, received = [], []
    for i, (tokens, sp) in enumerate(zip(token_lists, params, strict=True)):
        out = pre[f"p{i}"]
        assert out.finished and out.outputs[0].finish_reason is None
        handoff = sender.export(out.kv_handoff)
        kv = await receiver.receive(handoff, 5.0)
        if isinstance(kv, NixlBlockRead):
            kv.recompute_on_failure = not policy_fail
        received.append(kv)
        requests.append((f"d{i}", tokens, sp, {"handoff": dataclasses.replace(handoff, kv=kv)}))
    for request_id, tokens, sp, kwargs in requests:
        decode.add_request(
            request_id, {"prompt_token_ids": tokens}, sp, RequestOutputKind.FINAL_ONLY, **kwargs
        )
    return await drain(decode), received


def test_block_reads_of_a_concurrent_batch_equal_one_engine(pair, reference):
    token_lists = prompts(5)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i) for i in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    want = run_all(
        reference,
        [(f"r{i}", p, sp, {}) for i, (p, sp) in enumerate(zip(token_lists, params, strict=True))],
    )
    prefill, _, decode, _ = pair

    async def go() -> tuple[dict, list]:
        final, received = await hand_over(pair, token_lists, params)
        await wait_released(prefill)  # each READ's notification freed its blocks
        return final, received

    final, received = asyncio.run(go())
    for i in range(len(token_lists)):
        assert isinstance(received[i], NixlBlockRead)
        assert received[i].done_at is not None and received[i].error is None
        assert final[f"d{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids, i
    assert decode.stats().num_kv_imports == len(token_lists)
    assert_idle(prefill)
    assert_idle(decode)


def test_the_reads_owner_hears_of_the_first_step_once_the_blocks_are_in(pair, reference):
    """``on_first_step`` is called once per read, when every block is in and before the step
    that produces the request's first token here has any output (the decode replica tells
    the PD router then, which releases the prefill's first token)."""
    prefill, sender, decode, receiver = pair
    tokens = prompts(2, base=90)
    params = [SamplingParams(temperature=0, max_tokens=5)] * 2
    want, pre = reference_and_prefilled(reference, prefill, tokens, params)
    heard: list[tuple[int, bool, int]] = []  # (request, blocks all in, its outputs so far)
    outputs: list[str] = []  # the request id of each output, in order

    async def go() -> None:
        for i in range(2):
            handoff = sender.export(pre[f"p{i}"].kv_handoff)
            kv = await receiver.receive(handoff, 5.0)
            assert isinstance(kv, NixlBlockRead)
            kv.on_first_step = lambda i=i, kv=kv: heard.append(
                (i, kv.done_at is not None, outputs.count(f"d{i}"))
            )
            decode.add_request(
                f"d{i}",
                {"prompt_token_ids": tokens[i]},
                params[i],
                RequestOutputKind.DELTA,
                handoff=dataclasses.replace(handoff, kv=kv),
            )
        final: dict[str, list[int]] = {"d0": [], "d1": []}
        while decode.has_unfinished_requests():
            for out in decode.step():
                outputs.append(out.request_id)
                final[out.request_id] += out.outputs[0].token_ids
            await asyncio.sleep(0)
        for i in range(2):
            assert final[f"d{i}"] == want[f"r{i}"].outputs[0].token_ids[1:], i
        await wait_released(prefill)

    asyncio.run(go())
    assert sorted(heard) == [(0, True, 0), (1, True, 0)]
    assert_idle(prefill)
    assert_idle(decode)


def test_block_read_copies_the_prefill_blocks_exactly(pair):
    """The decode blocks hold the prefill blocks' bytes (every layer, K and V, every head)."""
    prefill, sender, decode, receiver = pair
    tokens = prompts(1, base=70)[0]  # 5 blocks of 16
    sp = SamplingParams(temperature=0, max_tokens=4)
    handoff = run_all(prefill, [("p", tokens, sp, {"export_kv": True})])["p"].kv_handoff

    async def go() -> list[int]:
        read = await receiver.receive(sender.export(handoff), 5.0)
        decode.kv.hold("test", [7, 8, 20, 3, 4])  # scattered destination blocks
        read.start([7, 8, 20, 3, 4])
        while not read.poll():
            await asyncio.sleep(0.001)
        await wait_released(prefill)
        return [7, 8, 20, 3, 4]

    dst = asyncio.run(go())
    src = list(handoff.block_ids)
    for (pk, pv), (dk, dv) in zip(prefill.runner.kv_caches, decode.runner.kv_caches, strict=True):
        assert torch.equal(pk[:, src], dk[:, dst]) and torch.equal(pv[:, src], dv[:, dst])
    decode.kv.release("test")
    assert_idle(prefill)
    assert_idle(decode)


@pytest.mark.parametrize("pair", [8], indirect=True)
def test_unequal_block_sizes_fall_back_to_tokens(pair, reference):
    token_lists = prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=10)] * 3
    want = run_all(
        reference,
        [(f"r{i}", p, sp, {}) for i, (p, sp) in enumerate(zip(token_lists, params, strict=True))],
    )
    prefill, _, decode, _ = pair

    async def go() -> tuple[dict, list]:
        out = await hand_over(pair, token_lists, params)
        await wait_released(prefill)
        return out

    final, received = asyncio.run(go())
    for i in range(3):
        assert isinstance(received[i], KVPayload)  # read into staging, imported as tokens
        assert final[f"d{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
    assert_idle(prefill)
    assert_idle(decode)


def held_prefills(path, hold_timeout_s: float) -> tuple[LLMEngine, NixlTransport, dict]:  # noqa: ANN001
    """A prefill engine with its transport, and three prompts it handed off (``p0``..``p2``),
    their blocks held by the engine until exported."""
    prefill = engine(path, num_kv_blocks=64)
    sender = NixlTransport(hold_timeout_s=hold_timeout_s, publish=Published)
    sender.attach(prefill, prefill.release_kv)
    sp = SamplingParams(temperature=0, max_tokens=4)
    outs = run_all(
        prefill, [(f"p{i}", p, sp, {"export_kv": True}) for i, p in enumerate(prompts(3))]
    )
    return prefill, sender, outs


def test_unread_blocks_are_freed_at_the_hold_timeout(tiny_llama_path):
    prefill, sender, outs = held_prefills(tiny_llama_path, hold_timeout_s=0.5)

    async def go() -> None:
        for out in outs.values():
            sender.export(out.kv_handoff)
        assert sender.num_held() == 3 and prefill.stats().num_kv_blocks_held > 0
        await wait_released(prefill, timeout_s=5.0)

    asyncio.run(go())
    assert sender.num_held() == 0
    assert_idle(prefill)
    sender.close()


def reference_and_prefilled(
    reference: LLMEngine, prefill: LLMEngine, tokens: list[list[int]], params: list
) -> tuple[dict, dict]:
    """The reference engine's outputs (``r{i}``) and the prefill engine's handed-off ones
    (``p{i}``) for the same prompts."""
    pairs = list(zip(tokens, params, strict=True))
    want = run_all(reference, [(f"r{i}", p, sp, {}) for i, (p, sp) in enumerate(pairs)])
    pre = run_all(
        prefill, [(f"p{i}", p, sp, {"export_kv": True}) for i, (p, sp) in enumerate(pairs)]
    )
    return want, pre


def _fail_or_recompute(pair, reference, broken, policy_fail: bool) -> None:  # noqa: ANN001
    """Decode from ``broken(handoff)`` handoffs: recompute gives the reference tokens, fail
    ends the request with an error; both sides end idle."""
    prefill, sender, decode, receiver = pair
    tokens = prompts(2, base=40)
    params = [SamplingParams(temperature=0, max_tokens=8)] * 2
    want, pre = reference_and_prefilled(reference, prefill, tokens, params)

    heard: list[int] = []  # reads whose owner heard that the request's first step starts
    reads: list[bool] = []  # whether request i got a block read (else refused at receive)

    async def go() -> dict:
        requests = []
        for i in range(2):
            handoff = broken(sender.export(pre[f"p{i}"].kv_handoff))
            try:
                kv = await receiver.receive(handoff, 1.0)
            except (KVTransportError, RuntimeError, TimeoutError):
                kv = None  # the decode replica's policy (deployments/decode.py) takes over
            reads.append(isinstance(kv, NixlBlockRead))
            if isinstance(kv, NixlBlockRead):
                kv.recompute_on_failure = not policy_fail
                kv.on_first_step = functools.partial(heard.append, i)
            requests.append(
                (f"d{i}", tokens[i], params[i], {"handoff": dataclasses.replace(handoff, kv=kv)})
            )
        for request_id, t, sp, kwargs in requests:
            decode.add_request(
                request_id, {"prompt_token_ids": t}, sp, RequestOutputKind.FINAL_ONLY, **kwargs
            )
        final = await drain(decode)
        await wait_released(prefill)
        return final

    final = asyncio.run(go())
    assert sorted(heard) == [i for i in range(2) if reads[i]]
    for i in range(2):
        out = final[f"d{i}"]
        if policy_fail:
            assert out.error and "could not be read" in out.error
        else:
            assert out.outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
    assert_idle(prefill)
    assert_idle(decode)


@pytest.mark.parametrize("policy_fail", [False, True])
def test_a_read_that_cannot_complete_recomputes_or_fails(pair, reference, policy_fail):
    """Blocks the prefill agent does not have (a freed registration, as after the replica
    restarted): NIXL refuses the read, the engine recomputes the prompt in place or ends
    the request, per policy, and the prefill side is told to free its blocks."""
    prefill = pair[0]

    def broken(handoff: KVHandoff) -> KVHandoff:
        far = prefill.kv_layout.num_blocks * 4  # past every registered region
        return dataclasses.replace(handoff, block_ids=tuple(far + b for b in handoff.block_ids))

    _fail_or_recompute(pair, reference, broken, policy_fail)


def test_a_delivered_handoff_decodes_like_one_engine(pair, reference):
    """Decode first: the decode side expects each request under a key, the prefill side
    delivers the exported handoff to that destination (a NIXL notification), and the decode
    engine reads the blocks from what arrived: the reference tokens, both sides idle."""
    prefill, sender, decode, receiver = pair
    tokens = prompts(3, base=20)
    params = [SamplingParams(temperature=0, max_tokens=6)] * 3
    want, pre = reference_and_prefilled(reference, prefill, tokens, params)

    async def go() -> dict:
        destinations = [receiver.expect(f"k{i}") for i in range(3)]
        exported = []
        for i, destination in enumerate(destinations):
            handoff = sender.export(pre[f"p{i}"].kv_handoff)
            await sender.deliver(handoff, destination)
            exported.append(handoff)
        for i in (2, 0, 1):
            handoff = await receiver.wait(f"k{i}", 5.0)
            receiver.forget(f"k{i}")  # taken: nothing to decline
            sent = exported[i]
            assert (handoff.handoff_id, handoff.block_ids) == (sent.handoff_id, sent.block_ids)
            assert handoff.metadata == sent.metadata
            assert handoff.output_token_ids == sent.output_token_ids
            assert handoff.ticket.agent_info == sender.info  # the info itself, not a ref
            kv = await receiver.receive(handoff, 5.0)
            assert isinstance(kv, NixlBlockRead)
            decode.add_request(
                f"d{i}",
                {"prompt_token_ids": tokens[i]},
                params[i],
                RequestOutputKind.FINAL_ONLY,
                handoff=dataclasses.replace(handoff, kv=kv),
            )
        final = await drain(decode)
        await wait_released(prefill)
        return final

    final = asyncio.run(go())
    for i in range(3):
        # The decode output counts the handed-off first token as its own.
        assert final[f"d{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
    assert sender.num_held() == 0
    assert_idle(prefill)
    assert_idle(decode)


def test_a_handoff_nobody_waits_for_is_declined_and_its_blocks_freed(tiny_llama_path, pair):
    """A delivery for a call that stopped waiting (before it came, or after it came and was
    not taken) is declined: the prefill replica frees the blocks at once, long before its
    hold timeout. A destination that cannot be reached refuses the delivery: the handoff
    stays held for the router to pass on."""
    _, _, decode, receiver = pair
    prefill, sender, outs = held_prefills(tiny_llama_path, hold_timeout_s=300.0)

    async def go() -> None:
        before = receiver.expect("left-before")
        receiver.forget("left-before")
        await sender.deliver(sender.export(outs["p0"].kv_handoff), before)
        after = receiver.expect("left-after")
        await sender.deliver(sender.export(outs["p1"].kv_handoff), after)
        deadline = time.monotonic() + 10
        while not receiver._inbox["left-after"].done():
            assert time.monotonic() < deadline, "the delivery did not arrive"
            await asyncio.sleep(0.01)
        receiver.forget("left-after")
        unsent = len(outs["p2"].kv_handoff.block_ids)  # still held by the engine
        deadline = time.monotonic() + 20
        while sender.num_held() or prefill.stats().num_kv_blocks_held > unsent:
            assert time.monotonic() < deadline, "declined blocks were not freed"
            await asyncio.sleep(0.01)
        gone = dataclasses.replace(after, agent_name="gone", agent_info=Missing())
        handoff = sender.export(outs["p2"].kv_handoff)
        with pytest.raises(KVTransportError, match="cannot be reached"):
            await sender.deliver(handoff, gone)
        assert sender.num_held() == 1
        sender._free(handoff.handoff_id)

    asyncio.run(go())
    assert_idle(prefill)
    assert_idle(decode)
    sender.close()


def test_an_expired_or_lost_ticket_is_refused_before_the_engine(pair, reference):
    sender = pair[1]

    def expired(handoff: KVHandoff) -> KVHandoff:
        return dataclasses.replace(
            handoff, ticket=dataclasses.replace(handoff.ticket, expires_at=time.time())
        )

    def lost(handoff: KVHandoff) -> KVHandoff:
        return dataclasses.replace(
            handoff, ticket=NixlTicket("gone-agent", Missing(), handoff.ticket.expires_at)
        )

    _fail_or_recompute(pair, reference, expired, policy_fail=False)
    _fail_or_recompute(pair, reference, lost, policy_fail=False)
    assert sender.num_held() == 0


def _dead_prefill_agent(queue) -> None:  # noqa: ANN001
    from nixl._api import nixl_agent

    agent = nixl_agent("doomed")
    cache = torch.zeros(8 << 20, dtype=torch.uint8)
    agent.register_memory([cache])
    queue.put((agent.get_agent_metadata(), cache.data_ptr()))
    time.sleep(3600)


def test_a_dead_prefill_process_fails_the_read_within_its_deadline(pair):
    """A prefill process that dies after the decode side loaded its agent: the READ errors or
    runs into its deadline, never hangs."""
    _, _, decode, receiver = pair
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_dead_prefill_agent, args=(queue,), daemon=True)
    process.start()
    metadata, address = queue.get(timeout=60)
    layout = dataclasses.replace(decode.kv_layout, num_blocks=1)
    region = layout.num_kv_heads * layout.block_bytes
    info = NixlAgentInfo(
        "doomed", metadata, tuple(address + r * region for r in range(layout.num_regions)), layout
    )
    assert region * layout.num_regions <= 8 << 20
    handoff = KVHandoff(
        metadata=_metadata(decode),
        output_token_ids=[5],
        handoff_id="h",
        layout=layout,
        block_ids=(0,),
        ticket=NixlTicket("doomed", Published(info), time.time() + 30),
    )

    async def go() -> tuple[float, str | None]:
        read = await receiver.receive(handoff, 3.0)
        process.kill()
        process.join()
        decode.kv.hold("dead", [0])
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - KVTransferError, from an error or the deadline
            read.start([0])
            while not read.poll():
                await asyncio.sleep(0.001)
        return time.monotonic() - start, read.error

    seconds, error = asyncio.run(go())
    assert error is not None and seconds < 5.0
    decode.kv.release("dead")
    assert_idle(decode)


def _metadata(eng: LLMEngine):  # noqa: ANN202
    from neuron_runtime.kv_transfer import KVMetadata

    return KVMetadata.describe(eng.config.model, [5])


def test_read_descriptors_merge_runs_on_both_sides():
    layout = KVLayout(num_layers=1, num_kv_heads=2, block_size=4, head_dim=2, num_blocks=10)
    bb = layout.block_bytes  # 32
    src, dst = read_descriptors(layout, (1000, 5000), 20, [3, 4, 5, 9], (100, 700), [0, 1, 2, 3])
    # Blocks 3-5 -> 0-2 merge; 9 -> 3 does not (the source skips). Region, head, run order.
    assert src[:, 1].tolist() == [3 * bb, bb] * 4
    assert src[:2, 0].tolist() == [1000 + 3 * bb, 1000 + 9 * bb]
    assert src[2:4, 0].tolist() == [1000 + (20 + 3) * bb, 1000 + (20 + 9) * bb]
    assert dst[:2, 0].tolist() == [100, 100 + 3 * bb]
    assert dst[2:4, 0].tolist() == [100 + 10 * bb, 100 + 13 * bb]
    assert dst[4, 0] == 700 and np.all(src[:, 2] == 0)
    # Descending on both sides merges too (a run covers [min, max]); opposite steps do not.
    src, dst = read_descriptors(layout, (0, 0), 20, [6, 5, 4, 1, 2], (0, 0), [9, 8, 7, 2, 1])
    assert (src[:3, 0] // bb).tolist() == [4, 1, 2] and (dst[:3, 0] // bb).tolist() == [7, 2, 1]
    assert (src[:3, 1] // bb).tolist() == [3, 1, 1]


def test_huge_pages_keep_the_regions_contents():
    """The cache regions move onto huge pages (where the kernel allows them) with their
    contents; a region without a whole aligned 2 MiB page inside is left as it is."""
    torch.manual_seed(0)
    regions = [torch.randn(3, 400, 16, 64), torch.randn(3, 400, 16, 64), torch.randn(3, 10, 16, 64)]
    expected = [r.clone() for r in regions]
    addresses = [r.data_ptr() for r in regions]
    moved = use_huge_pages(regions)
    assert all(torch.equal(r, e) for r, e in zip(regions, expected, strict=True))
    assert [r.data_ptr() for r in regions] == addresses  # registered addresses stay valid
    assert moved % HUGE_PAGE_BYTES == 0
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            allowed = "[never]" not in f.read()
    except OSError:
        allowed = False
    if allowed:  # the two 4.7 MiB regions hold at least one aligned 2 MiB page each
        assert moved >= 2 * HUGE_PAGE_BYTES
    assert use_huge_pages([regions[2]]) == 0


def test_notifications_are_polled_as_often_as_the_oldest_waiting_call_needs():
    """No call waiting: every NOTIFY_POLL_MAX_S. Else 1/NOTIFY_POLL_SHARE of the oldest
    waiting call's wait so far (its delivery's notice costs its TTFT that share at most),
    bounded on both sides."""
    transport = NixlTransport("UCX", 30.0)
    assert transport._poll_interval() == NOTIFY_POLL_MAX_S
    now = time.monotonic()
    transport._expected_at = {"new": now}
    assert transport._poll_interval() == NOTIFY_POLL_MIN_S
    transport._expected_at = {"old": now - 0.32, "new": now}
    assert transport._poll_interval() == pytest.approx(0.32 / NOTIFY_POLL_SHARE, rel=0.05)
    transport._expected_at = {"old": now - 60.0}
    assert transport._poll_interval() == NOTIFY_POLL_MAX_S


def test_config_names_the_transport():
    assert KVTransportConfig().name == "nixl"
    assert make_transport(KVTransportConfig("object_store")).name == "object_store"
    assert isinstance(make_transport(KVTransportConfig()), NixlTransport)
    with pytest.raises(ValueError, match="unknown KV transport"):
        KVTransportConfig("gloo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hold_timeout_s"):
        KVTransportConfig(hold_timeout_s=0)


@pytest.mark.parametrize(
    "backend,setting,layer_wise",
    [
        ("UCX", None, False),
        ("LIBFABRIC", None, True),
        ("UCX", True, True),
        ("LIBFABRIC", False, False),
    ],
)
def test_reads_are_layer_wise_where_the_adapter_copies_unless_set(backend, setting, layer_wise):
    """Unset, block reads overlap the first step only where no core copies (EFA's RDMA)."""
    config = KVTransportConfig(nixl_backend=backend, nixl_layer_wise=setting)
    transport = make_transport(config)
    assert isinstance(transport, NixlTransport) and transport.layer_wise is layer_wise


def test_an_unavailable_backend_is_refused_at_attach(tiny_llama_path):
    with pytest.raises(ValueError, match="NIXL backend 'NO_SUCH'"):
        NixlTransport("NO_SUCH", publish=Published).attach(engine(tiny_llama_path), print)
