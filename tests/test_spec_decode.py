"""Speculative decoding: each proposer's greedy output equals the engine's without
speculation (tiny random models: prefix caching, chunked prefill, preemption, n > 1, mixed
batches), and KV blocks return to the baseline after rejections."""

from __future__ import annotations

import json
import random

import pytest
from conftest import make_tiny_llama
from spec_decode_heads import make_eagle_head

from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.llm import LLM
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.spec_decode.config import SpeculativeConfig
from neuron_runtime.spec_decode.metrics import (
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
)
from neuron_runtime.spec_decode.ngram import ngram_propose

MAX_MODEL_LEN = 256
# Token ids of the tiny models' shared vocabulary: repeats give the n-gram proposer matches.
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18] * 4 + [11, 12, 13],
    list(range(300, 340)),
    [7, 8, 9],
    [21, 22, 23, 24] * 10 + list(range(500, 520)) + [21, 22],
]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_1layer_path(tmp_path_factory, default_model_path):
    """Another random Llama (1 layer, other weights): mostly rejected drafts."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("draft-1layer"), default_model_path, num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def eagle_paths(tmp_path_factory, tiny_llama_path):
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    return {
        method: make_eagle_head(tmp_path_factory.mktemp(method), cfg, method)
        for method in ("eagle", "eagle3")
    }


@pytest.fixture(scope="module")
def spec_configs(tiny_llama_path, draft_1layer_path, eagle_paths) -> dict[str, dict]:
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        },
        # The target itself as the draft: every draft accepted, k + 1 tokens per step.
        "draft_same": {
            "method": "draft_model",
            "num_speculative_tokens": 4,
            "model": str(tiny_llama_path),
        },
        "draft_other": {
            "method": "draft_model",
            "num_speculative_tokens": 3,
            "model": str(draft_1layer_path),
        },
        "self_spec": {"method": "draft_model", "num_speculative_tokens": 2, "num_draft_layers": 1},
        "eagle": {
            "method": "eagle",
            "num_speculative_tokens": 3,
            "model": str(eagle_paths["eagle"]),
        },
        "eagle3": {
            "method": "eagle3",
            "num_speculative_tokens": 3,
            "model": str(eagle_paths["eagle3"]),
        },
    }


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """The engine without speculation (defaults: prefix caching, chunked prefill)."""
    llm = LLM(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


def _check_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_held == 0
    assert stats.num_unfinished_outputs == 0


ENGINE_VARIANTS = {
    "default": {},
    # 24-token steps: prompts are prefilled in chunks; verify slices share the budget.
    "chunked": {"max_num_batched_tokens": 24},
    # 24 blocks of 8 tokens for ~240 tokens: requests are preempted and recomputed.
    "preempting": {"num_kv_blocks": 24, "block_size": 8, "max_model_len": 128},
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
@pytest.mark.parametrize(
    "method", ["ngram", "draft_same", "draft_other", "self_spec", "eagle", "eagle3"]
)
def test_greedy_output_identical_to_no_speculation(
    tiny_llama_path, spec_configs, reference, method, variant
):
    engine_args = {"num_kv_blocks": 256, "max_model_len": MAX_MODEL_LEN}
    engine_args.update(ENGINE_VARIANTS[variant])
    llm = LLM(model=str(tiny_llama_path), speculative_config=spec_configs[method], **engine_args)
    outputs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_drafts > 0
    if variant == "preempting":
        assert stats.num_preemptions > 0
    _check_idle(llm)
    if variant == "default":
        # Again: the prompts' full blocks now come from the prefix cache.
        hits = stats.prefix_cache_hits
        again = llm.generate(PROMPTS, greedy())
        assert [o.outputs[0].token_ids for o in again] == reference
        assert llm.engine.stats().prefix_cache_hits > hits
        _check_idle(llm)


def test_all_accepted_drafts_emit_k_plus_one_tokens_per_step(tiny_llama_path, spec_configs):
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        speculative_config=spec_configs["draft_same"],
    )
    llm.generate(PROMPTS[:1], greedy(21))
    stats = llm.engine.stats().spec_decode
    # 1 token from the prompt, then 4 verify steps of 5 tokens.
    assert stats.num_drafts == 4 and stats.num_accepted_tokens == stats.num_draft_tokens == 16
    assert stats.num_accepted_tokens_per_pos == (4, 4, 4, 4)


def test_n_samples_and_mixed_batch(tiny_llama_path, spec_configs, reference):
    """n=2 greedy children, a penalized request (never speculates) and a seeded sampled one
    in the same batch as speculating requests."""
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        speculative_config=spec_configs["draft_other"],
    )
    plain = LLM(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)
    penalized = greedy().replace(repetition_penalty=1.3)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    params = [greedy().replace(n=2), penalized, sampled, greedy()]
    outputs = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in outputs[0].outputs] == [reference[0]] * 2
    assert outputs[3].outputs[0].token_ids == reference[3]
    expected = plain.generate(PROMPTS[1], penalized)[0].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == expected
    # A seeded request gives the same tokens alone and in another batch.
    alone = llm.generate(PROMPTS[2], sampled)[0].outputs[0].token_ids
    assert outputs[2].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0], PROMPTS[2]], [greedy(), sampled])
    assert again[1].outputs[0].token_ids == alone
    _check_idle(llm)


def test_rejected_drafts_free_their_blocks(tiny_llama_path, spec_configs):
    """Step by step: no request holds blocks beyond what its next verify needs, rejections
    happen, and every block is free once the requests are done."""
    args = EngineArgs(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        block_size=4,
        enable_prefix_caching=False,
        speculative_config=spec_configs["draft_other"],
    )
    llm = LLM(**{k: v for k, v in vars(args).items()})
    engine = llm.engine
    baseline = engine.stats()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(30))
    bs = 4
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            needed = -(-(request.num_tokens + len(request.spec_token_ids)) // bs)
            assert len(request.block_table) <= needed
    stats = engine.stats()
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    assert stats.num_kv_blocks_free == baseline.num_kv_blocks_free == 64
    _check_idle(llm)


def test_abort_mid_speculation_frees_everything(tiny_llama_path, spec_configs):
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        speculative_config=spec_configs["eagle"],
    )
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(40))
    for _ in range(4):
        engine.step()
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    for i in range(len(PROMPTS)):
        engine.abort_request(str(i))
    assert not engine.has_unfinished_requests()
    _check_idle(llm)
    engine.step()  # the proposer forgets the aborted requests
    assert not engine.spec.proposer._pending


def test_metrics_use_vllm_names(tiny_llama_path, spec_configs):
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        speculative_config=spec_configs["draft_same"],
    )
    llm.generate(PROMPTS[:2], greedy(11))
    stats = llm.engine.stats().spec_decode
    values = {(name, tuple(labels.items())): v for name, labels, v in stats.metrics()}
    assert values[(NUM_DRAFTS, ())] == stats.num_drafts > 0
    assert values[(NUM_DRAFT_TOKENS, ())] == stats.num_draft_tokens
    assert values[(NUM_ACCEPTED_TOKENS, ())] == stats.num_accepted_tokens
    assert values[(NUM_ACCEPTED_TOKENS_PER_POS, (("position", "0"),))] > 0
    assert NUM_DRAFTS == "vllm:spec_decode_num_drafts"
    assert 0 < stats.acceptance_rate <= 1 and 1 < stats.mean_acceptance_length <= 5


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 1, 2) == [3, 4]
    assert ngram_propose([1, 2, 3, 9, 2, 3], 3, 1, 3) == [9, 2, 3]  # the 2-gram [2, 3]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_propose([5, 5], 4, 2, 3) == []  # below prompt_lookup_min
    assert ngram_propose([7, 1, 7, 2, 7], 1, 1, 1) == [2]  # the latest earlier occurrence


def test_ngram_propose_equals_a_plain_search():
    """Against a token-by-token search, on ids whose bytes repeat across token boundaries
    (the proposer searches the ids' bytes)."""

    def plain(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        length = len(tokens)
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            for i in range(length - 1 - n, -1, -1):
                if tokens[i : i + n] == tokens[length - n :]:
                    return tokens[i + n : i + n + k]
        return []

    rng = random.Random(0)
    values = [0, 1, 257, 65793, 16843009, 49151]  # 0x0101, 0x010101, 0x01010101
    for _ in range(2000):
        tokens = [rng.choice(values[: rng.randint(2, 6)]) for _ in range(rng.randint(1, 12))]
        lo = rng.randint(1, 3)
        args = (rng.randint(1, 4), lo, lo + rng.randint(0, 2))
        assert ngram_propose(tokens, *args) == plain(tokens, *args), (tokens, args)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "num_draft_layers"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
    ],
)
def test_invalid_speculative_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(config)


def test_engine_config_checks(tiny_llama_path, draft_1layer_path):
    args = dict(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineArgs(**args, speculative_config=spec).create_engine_config()
    assert config.speculative == SpeculativeConfig("ngram", 2)
    self_spec = {"method": "draft_model", "num_speculative_tokens": 2, "num_draft_layers": 1}
    with pytest.raises(ValueError, match="method 'draft_model' runs with graph_mode 'eager'"):
        EngineArgs(
            **args, speculative_config=self_spec, graph_mode="inductor"
        ).create_engine_config()
    with pytest.raises(ValueError, match="num_draft_layers must be in"):
        LLM(**args, speculative_config={**spec, "method": "draft_model", "num_draft_layers": 2})


def test_serve_config_takes_speculative_config():
    from app.builder import BuildArgs

    args = BuildArgs(
        engine_args={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    )
    assert args.full_engine_args()["speculative_config"]["method"] == "ngram"


def test_real_model_ngram_greedy_identical(default_model_path):
    """The embedded model on a repetitive chat request: n-gram drafts get accepted and the
    output is the engine's own without speculation."""
    prompts = [
        [
            {
                "role": "user",
                "content": "Repeat this line three times: the quick brown fox jumps "
                "over the lazy dog.",
            }
        ],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    args = dict(model=str(default_model_path), max_model_len=512, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM(**args).chat(prompts, params)
    spec = LLM(**args, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outputs = spec.chat(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert "Paris" in outputs[1].outputs[0].text
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
    _check_idle(spec)


@pytest.mark.parametrize("method", ["ngram", "draft_same", "self_spec", "eagle"])
def test_decode_role_engine_speculates_after_a_kv_handoff(
    tiny_llama_path, spec_configs, reference, method
):
    """Disaggregated: a prefill engine hands the prompt's KV to a decode engine that
    speculates; the tokens are the single engine's without speculation. (EAGLE's head sees
    the target's hidden states from the first decode step on: its drafts for the first
    positions are weaker, the output the same.)"""
    args = dict(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    prefill = LLMEngine.from_engine_args(EngineArgs(**args))
    decode = LLMEngine.from_engine_args(EngineArgs(**args, speculative_config=spec_configs[method]))
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"p{i}", prompt, greedy(), export_kv=True)
    handoffs = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            if out.finished:
                handoff = out.kv_handoff
                handoff.kv = prefill.read_kv(handoff)
                prefill.release_kv(handoff.handoff_id)
                handoffs[out.request_id] = handoff
    for i, prompt in enumerate(PROMPTS):
        decode.add_request(f"d{i}", prompt, greedy(), handoff=handoffs[f"p{i}"])
    final = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert [final[f"d{i}"] for i in range(len(PROMPTS))] == reference
    assert decode.stats().spec_decode.num_drafts > 0
    for engine in (prefill, decode):
        stats = engine.stats()
        assert stats.num_kv_blocks_used == stats.num_kv_blocks_held == 0


def test_disable_by_batch_size(tiny_llama_path, spec_configs):
    config = {**spec_configs["draft_same"], "disable_by_batch_size": 2}
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=128,
        speculative_config=config,
    )
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(4 if i < 2 else 24))
    while engine.has_unfinished_requests():
        engine.step()
        drafting = [r for r in engine.scheduler.running if r.spec_token_ids]
        assert not drafting or len(engine.scheduler.running) <= 2
    assert engine.stats().spec_decode.num_drafts > 0
    _check_idle(llm)


def test_serve_config_check_names_a_bad_speculative_config():
    """A shipped-config check (app.builder.validate_args, run by app.config_check) fails at
    once on a speculative_config the engine would refuse."""
    from app.builder import BuildArgs, validate_args

    for spec, message in (
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "no-such-head"}, "model"),
    ):
        args = BuildArgs(max_model_len=512, engine_args={"speculative_config": spec})
        with pytest.raises(ValueError, match=f"speculative_config.{message}"):
            validate_args(args)


def test_backoff_when_drafts_keep_failing(tiny_llama_path, spec_configs):
    """Drafts that are never accepted: the request stops proposing for 8, then 16, ... steps,
    so most steps decode one token; without back-off every step drafts."""
    counts = {}
    for rate in (0.0, 0.1):
        config = {**spec_configs["eagle"], "min_acceptance_rate": rate}
        llm = LLM(
            model=str(tiny_llama_path),
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=64,
            speculative_config=config,
        )
        llm.generate(PROMPTS[2], greedy(60))
        stats = llm.engine.stats().spec_decode
        assert stats.num_accepted_tokens == 0
        counts[rate] = stats.num_drafts
        if rate:  # three failed drafts of k = 3, then single-token probes only
            assert stats.num_draft_tokens == 3 * 3 + (stats.num_drafts - 3)
    assert counts[0.0] >= 40 and counts[0.1] <= 6
