"""Greedy constrained rows without a mask: the matcher's check of the model's own pick, the
masked argmax only where the grammar refuses it, and rows filled only on demand.

References: llguidance's full token mask filled into a fresh tensor, a token-by-token argmax
over its allowed tokens, and the engine's mask-first sampling path (temperature 1, top_k 1:
the argmax over the masked logits) for whole generations.
"""

from __future__ import annotations

import time

import pytest
import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.structured_output import (
    GrammarCompiler,
    StructuredOutputManager,
    StructuredOutputsParams,
)
from neuron_runtime.structured_output.bitmask import fix_greedy_tokens
from neuron_runtime.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}},
            },
            "required": ["id", "tags"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["user", "ok"],
}
# Constraint, then a valid answer walked token by token. Forced bytes (a JSON key, a regex or
# grammar literal) are where llguidance's mask is narrower than its per-token check.
WALKS = {
    "json": (dict(json=PERSON), '{"name": "Al", "age": 42}'),
    "json nested": (
        dict(json=NESTED, disable_any_whitespace=True),
        '{"user":{"id":7,"tags":["beta"]},"ok":true}',
    ),
    "regex": (dict(regex=r"Answer: (yes|no)\. [a-z]+ [a-z]+"), "Answer: yes. it is"),
    "choice": (dict(choice=["yes", "yesterday"]), "yesterday"),
    "grammar": (
        dict(grammar='start: "SUM(" item ("," item)* ")"\nitem: /[0-9]{1,3}/'),
        "SUM(1,22)",
    ),
}


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id)


def ready(manager: StructuredOutputManager, req_ids: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not all(manager.status(r, [])[0] for r in req_ids):
        assert time.monotonic() < deadline
        manager.wait_for_compiles(0.1)


def full_mask(matcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: llguidance's mask for the matcher's next token, filled afresh."""
    import llguidance.torch

    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


@pytest.fixture(scope="module")
def token_texts(tokenizer, compiler) -> list[str]:
    hf = tokenizer.hf_tokenizer
    return hf.batch_decode([[t] for t in range(compiler.vocab_size)])


@pytest.mark.parametrize("kind", list(WALKS))
def test_an_unfilled_row_allows_no_token_its_mask_refuses(compiler, tokenizer, token_texts, kind):
    """At every position of a valid answer, an on-demand row's check allows only tokens the
    full mask allows, and refuses beyond the mask EOS alone (once the grammar stopped). The
    tokens checked: every one the mask allows, every one that starts the rest of the answer
    (where a forced literal makes the mask narrower than the matcher's check) and every 16th.
    The check fills the row only where the grammar forces bytes."""
    fields, text = WALKS[kind]
    manager = StructuredOutputManager(compiler, fill_ahead=False)
    manager.add("r", StructuredOutputsParams(**fields))
    ready(manager, ["r"])
    vocab, eos = compiler.vocab_size, tokenizer.eos_token_id
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate([*ids, eos]):
        row = manager.bitmask(["r"])["r"]
        mask = full_mask(manager.states["r"].matcher, vocab)
        rest = text[len(tokenizer.decode(ids[:i])) :]
        starts = {t for t, s in enumerate(token_texts) if s and rest.startswith(s)}
        candidates = sorted(set(mask.nonzero().flatten().tolist()) | starts | {eos})
        candidates += range(0, vocab, 16)
        checked = {t: row.allows(t) for t in candidates}
        assert row.filled.done() == bool(manager.states["r"].matcher.compute_ff_bytes())
        assert not [t for t, ok in checked.items() if ok and not mask[t]], "mask refuses"
        assert {t for t, ok in checked.items() if mask[t] and not ok} <= {eos}
        assert checked[token] or token == eos
        # Filled, the row is the full mask and answers from its bits.
        assert torch.equal(full_mask_of(row.get(), vocab), mask) and row.filled.done()
        assert row.allows(token)
        if token != eos:
            assert manager.accept("r", token)
    manager.release("r")
    assert manager.num_states == 0


def full_mask_of(words: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


@pytest.mark.parametrize("fill_ahead", [False, True])
def test_fixed_greedy_tokens_are_the_argmax_over_allowed_tokens(compiler, tokenizer, fill_ahead):
    """Rows whose unmasked argmax the grammar allows keep it without a fill (on demand); the
    others take the argmax over their allowed tokens; free rows are untouched."""
    manager = StructuredOutputManager(compiler, fill_ahead=fill_ahead)
    kinds = {"digits": dict(regex="[0-9]{2,4}"), "colour": dict(choice=["red", "blue"])}
    for req_id, fields in kinds.items():
        manager.add(req_id, StructuredOutputsParams(**fields))
    ready(manager, list(kinds))
    vocab = compiler.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(7))
    (seven,) = tokenizer.encode("7", add_special_tokens=False)
    logits[1, seven] = 50.0  # the digits row's own pick is allowed
    order = ["free", "digits", "colour", "free2"]
    masks = {r: full_mask(manager.states[r].matcher, vocab) for r in kinds}
    rows = manager.bitmask(order)
    tokens = logits.argmax(dim=-1)
    fixed = fix_greedy_tokens(logits, tokens, [rows.get(r) for r in order])
    expected = tokens.clone()
    for row, req_id in enumerate(order):
        if req_id in masks:
            allowed = masks[req_id].nonzero().flatten().tolist()
            expected[row] = max(allowed, key=lambda t: (float(logits[row, t]), -t))
    assert fixed.tolist() == expected.tolist()
    assert fixed[1] == seven and fixed[2] != tokens[2]
    assert rows["digits"].filled.done() == fill_ahead  # allowed as picked: no fill on demand
    assert rows["colour"].filled.done()
    for req_id in kinds:
        manager.release(req_id)


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(model=str(default_model_path), max_model_len=512, num_kv_blocks=128)


@pytest.mark.parametrize("fill_ahead", [False, True])
def test_greedy_generations_equal_the_mask_first_path(llm, fill_ahead):
    """Greedy constrained generations (masks only where the model's pick is refused) equal
    the mask-first sampler's (temperature 1 with top_k 1 masks every row before sampling),
    filled ahead on the manager's thread or on demand."""
    manager = llm.engine.structured
    default = manager.fill_ahead
    manager.fill_ahead = fill_ahead
    try:
        kinds = [
            dict(json=PERSON, disable_any_whitespace=True),
            dict(regex=r"([a-z]+ ){3,}"),
            dict(choice=["The sea", "A river", "Rain"]),
        ]
        prompts = ["A person as JSON:", "Words about the sea:", "Name some water:"]
        greedy = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=k) for k in kinds]
        top1 = [p.replace(temperature=1.0, top_k=1, seed=3) for p in greedy]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, top1)]
    finally:
        manager.fill_ahead = default
    assert got == ref
    stats = llm.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_grammar_states) == (0, 0, 0)
