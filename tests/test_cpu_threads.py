"""The CPU kernels' thread pool: outputs identical for every pool size, callers from several
Python threads at once, no CPU used while idle, the engine's greedy tokens unchanged."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends import cpu_kernels


@pytest.fixture(scope="module")
def k():
    fused = cpu_kernels.kernels()
    assert fused is not None, "the CPU kernels did not build"
    before = fused.num_threads()
    yield fused
    fused.set_num_threads(before)


def at_threads(k, n: int, fn):  # noqa: ANN001, ANN202
    k.set_num_threads(n)
    assert k.num_threads() == n
    return fn()


def test_pool_size_is_set_and_checked(k):
    for n in (3, 1, 2):
        k.set_num_threads(n)
        assert k.num_threads() == n
    with pytest.raises(ValueError, match="num_threads"):
        k.set_num_threads(0)


# Shapes that split: one row over many panels (decode), 32 rows, many row blocks over few
# panels (a prefill through a narrow projection), a panel count below the thread count.
@pytest.mark.parametrize(
    "rows,width,out", [(1, 576, 1536), (32, 576, 960), (130, 129, 67), (700, 64, 40), (3, 7, 5)]
)
def test_linear_identical_on_1_2_and_3_threads(k, rows, width, out):
    g = torch.Generator().manual_seed(rows + out)
    x, w, b = torch.randn(rows, width, generator=g), torch.randn(out, width, generator=g), None
    b = torch.randn(out, generator=g)
    packed = k.pack(w)
    one, two, three = (at_threads(k, n, lambda: k.linear(x, packed, b, out)) for n in (1, 2, 3))
    assert torch.equal(one, two) and torch.equal(one, three)
    expected = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(two, expected, atol=1e-5 * width**0.5, rtol=1e-5)


@pytest.mark.parametrize("d,window,softcap", [(64, None, None), (8, None, None), (64, 20, 30.0)])
def test_decode_attention_identical_on_1_and_2_threads(k, d, window, softcap):
    torch.manual_seed(8)
    rng = random.Random(8)
    heads, kv_heads, bs, num_blocks = 9, 3, 16, 400
    k_cache = torch.randn(kv_heads, num_blocks, bs, d)
    v_cache = torch.randn(kv_heads, num_blocks, bs, d)
    free = list(range(num_blocks))
    rng.shuffle(free)
    lens = [rng.randint(1, 150) for _ in range(37)]
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads + 2 * kv_heads, d)[:, :heads]
    args = (q, k_cache, v_cache, padded, torch.tensor(lens), d**-0.5, window, softcap)
    one, two = (at_threads(k, n, lambda: k.decode_attention(*args)) for n in (1, 2))
    assert torch.equal(one, two)
    # and right: sequence 0 against a float64 softmax over its keys
    flat = torch.tensor([b * bs + j for b in tables[0] for j in range(bs)])[: lens[0]]
    keys = k_cache.view(kv_heads, -1, d)[:, flat].double().repeat_interleave(3, dim=0)
    values = v_cache.view(kv_heads, -1, d)[:, flat].double().repeat_interleave(3, dim=0)
    if window:
        keys, values = keys[:, -window:], values[:, -window:]
    scores = torch.einsum("hd,hnd->hn", q[0].double(), keys) * d**-0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    expected = torch.einsum("hn,hnd->hd", scores.softmax(-1), values).float()
    torch.testing.assert_close(two[0], expected, atol=1e-5, rtol=1e-5)


def test_row_kernels_identical_on_1_and_2_threads(k):
    """Row counts large enough that the per-row kernels split (a prefill's rows)."""
    g = torch.Generator().manual_seed(9)
    rows, hidden, inter, heads, d = 300, 576, 1536, 12, 64
    x0, res = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    gate_up = torch.randn(rows, 2 * inter, generator=g)
    qk0 = torch.randn(rows, heads + 3, d, generator=g)
    angles = torch.rand(rows, d // 2, generator=g) * 10
    logits = torch.randn(8, 49152, generator=g)
    slots = torch.randperm(4 * rows, generator=g)[:rows]

    def run():  # noqa: ANN202
        x, qk = x0.clone(), qk0.clone()
        normed = k.add_rms_norm(x, res, weight, 1e-5)
        k.rotary_(qk, angles.cos(), angles.sin(), heads)
        k_cache, v_cache = (
            torch.zeros(3, 4 * rows // 16, 16, d),
            torch.zeros(3, 4 * rows // 16, 16, d),
        )
        k.write_kv(qk[:, heads:], qk[:, :3], k_cache, v_cache, slots)
        return x, normed, k.silu_and_mul(gate_up), qk, k_cache, v_cache, k.argmax(logits)

    one, two = (at_threads(k, n, run) for n in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    x, normed, act, _, k_cache, _, top = two
    torch.testing.assert_close(x, x0 + res, atol=0, rtol=0)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache.view(3, -1, d)[:, slots], two[3][:, heads:].transpose(0, 1))
    assert top.tolist() == logits.argmax(dim=-1).tolist()


def test_callers_on_several_python_threads_at_once(k):
    """ctypes drops the GIL: a second caller runs its job alone while the pool is busy."""
    k.set_num_threads(2)
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(16, 256, generator=g), torch.randn(1000, 256, generator=g)
    packed = k.pack(w)
    expected = k.linear(x, packed, None, 1000)
    results: list[bool] = []

    def call() -> None:
        results.extend(torch.equal(k.linear(x, packed, None, 1000), expected) for _ in range(50))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 150


# Many small jobs back to back on a pool of 3 (more threads than this machine's cores, so
# workers get preempted mid-job): every task of every job runs once, with its own job's context.
POOL_STRESS = r"""
#include "cpu_kernels.c"
#include <stdio.h>
struct job { int64_t tasks; _Atomic int *hits; };
static _Atomic long stray;
static void count(const void *ctx, int64_t begin, int64_t end) {
    const struct job *j = ctx;
    for (int64_t t = begin; t < end; t++) {
        if (t < j->tasks) atomic_fetch_add(&j->hits[t], 1);
        else atomic_fetch_add(&stray, 1);
    }
}
int main(void) {
    set_num_threads(3);
    const int64_t until = now_ns() + 2000000000LL;
    long jobs = 0, wrong = 0;
    srand(1);
    while (now_ns() < until) {
        _Atomic int hits[64] = {0};
        const struct job j = {1 + rand() % 40, hits};
        parallel_for(count, &j, j.tasks, 1 + rand() % 3);
        for (int64_t t = 0; t < j.tasks; t++) wrong += hits[t] != 1;
        jobs++;
    }
    printf("%ld jobs, %ld tasks not run once, %ld out of range\n", jobs, wrong, (long)stray);
    return wrong != 0 || stray != 0;
}
"""


def test_pool_runs_every_task_once_under_preemption(tmp_path):
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler is not None
    (tmp_path / "stress.c").write_text(POOL_STRESS)
    binary = tmp_path / "stress"
    subprocess.run(
        [compiler, *cpu_kernels.COMPILE_FLAGS, f"-I{cpu_kernels.SOURCE.parent}"]
        + [str(tmp_path / "stress.c"), "-o", str(binary), "-lm"],
        check=True,
        timeout=cpu_kernels.BUILD_TIMEOUT_S,
    )
    # A lost task would leave the caller waiting for it: the timeout turns that into a failure.
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_idle_pool_sleeps(k):
    k.set_num_threads(2)
    x, packed = torch.randn(1, 64), k.pack(torch.randn(512, 64))
    for _ in range(10):
        k.linear(x, packed, None, 512)
    time.sleep(0.1)  # past the workers' spin
    start = time.process_time()  # every thread of this process
    time.sleep(0.5)
    assert time.process_time() - start < 0.05


def test_engine_greedy_tokens_identical_on_1_and_2_threads(k):
    """The default model, a batch of different prompt lengths, greedy: the same tokens."""
    llm = LLM(max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [
        {"prompt_token_ids": tok.encode(p)}
        for p in [
            "The capital of France is",
            "Write a short story about a lighthouse keeper and the sea. Once upon a time,",
            "1, 2, 3,",
            "Hi",
        ]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for n in (1, 2):
        k.set_num_threads(n)
        outputs[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[1] == outputs[2]


def test_replica_threads_follow_its_cpu_allotment(serve_cluster):
    """A serving replica sizes its engine's pools from ``ray_actor_options.num_cpus``."""
    import ray

    from deployments.engine_replica import replica_num_threads

    @ray.remote
    class Probe:
        def threads(self) -> int | None:
            return replica_num_threads()

    for cpus, expected in [(1.5, 2), (1, 1), (0.25, 1)]:
        probe = Probe.options(num_cpus=cpus).remote()
        assert ray.get(probe.threads.remote()) == expected
        ray.kill(probe)


def test_cpu_backend_sizes_the_pool_and_keeps_torch_at_one_thread(k):
    from neuron_runtime.backends.base import get_backend

    before = torch.get_num_threads()
    try:
        for n in (2, 1, 3):
            get_backend("cpu", n)
            assert k.num_threads() == n and torch.get_num_threads() == 1
        get_backend("cpu", None)  # offline default: every core this process may use
        assert k.num_threads() == len(os.sched_getaffinity(0))
        with pytest.raises(ValueError, match="num_threads"):
            get_backend("cpu", 0)
    finally:
        torch.set_num_threads(before)
