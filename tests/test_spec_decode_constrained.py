"""Speculative decoding of grammar-constrained, stop-string and logprobs requests.

References are independent of the speculative path: the same model in an engine without
speculation (greedy tokens, stop strings, logprobs), fresh llguidance matchers advanced
through each draft prefix (the verify step's bitmask rows), ``jsonschema`` and ``re`` on the
text, and a fresh computation of a grammar-masked distribution (the rejection rule).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import llguidance.torch
import pytest
import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.request import Request
from neuron_runtime.sampler import SamplingBatch
from neuron_runtime.spec_decode.rejection import rejection_sample, target_probs
from neuron_runtime.structured_output import (
    StructuredOutputManager,
    StructuredOutputsParams,
    apply_token_bitmask,
)

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
COLOURS = ["red", "green", "light blue"]
REPEAT = "Repeat this line three times: the quick brown fox jumps over the lazy dog."


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def constrained(
    temperature: float = 0.0, max_tokens: int = 64, logprobs: int | None = None, **kind
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=None if temperature == 0 else 7,
        max_tokens=max_tokens,
        logprobs=logprobs,
        structured_outputs=StructuredOutputsParams(**kind),
    )


# One greedy batch: constrained rows (JSON schema, regex, choice) beside free rows.
CONVS = [ask("List three people as JSON."), ask("Give a date."), ask("Pick a colour.")]
CONVS += [ask(REPEAT), ask("What is the capital of France?")]
GREEDY = [
    constrained(max_tokens=72, logprobs=2, json=PEOPLE),
    constrained(max_tokens=12, regex=DATE),
    constrained(max_tokens=8, choice=COLOURS),
    SamplingParams(temperature=0.0, max_tokens=32, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=12),
]
ARGS = dict(max_model_len=512, num_kv_blocks=128)


@pytest.fixture(scope="module")
def plain(default_model_path) -> LLM:
    return LLM(model=str(default_model_path), **ARGS)


@pytest.fixture(scope="module")
def spec(default_model_path) -> LLM:
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "min_acceptance_rate": 0.0,  # no back-off: every request drafts k tokens each step
    }
    return LLM(model=str(default_model_path), **ARGS, speculative_config=speculative)


@pytest.fixture(scope="module")
def reference(plain):
    return plain.chat(CONVS, GREEDY)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_constrained_texts(outputs) -> None:
    texts = [o.outputs[0].text for o in outputs]
    jsonschema.validate(json.loads(texts[0]), PEOPLE)
    assert re.fullmatch(DATE, texts[1]), texts[1]
    assert texts[2] in COLOURS


def max_logprob_diff(a, b) -> float:
    """Largest difference between two outputs' logprob entries (same tokens, same keys)."""
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    assert [set(e) for e in a.logprobs] == [set(e) for e in b.logprobs]
    return max(abs(x[t] - y[t]) for x, y in zip(a.logprobs, b.logprobs, strict=True) for t in x)


# fp32 rounding: a verify slice runs k + 1 rows through every matmul where a decode step runs
# one, and the sums come out in another order (~5e-5 seen on logprobs of magnitude 1-7).
LOGPROB_TOL = 1e-4


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_used == 0 and stats.num_grammar_states == 0


def record_drafts(llm: LLM, monkeypatch) -> list[tuple[str, int, list[int]]]:
    """(req_id, output length, draft) for every draft the SpecDecoder hands the scheduler."""
    decoder = llm.engine.spec
    assert decoder is not None
    seen: list[tuple[str, int, list[int]]] = []
    propose = decoder.propose

    def spy(running: list[Request]) -> None:
        propose(running)
        seen.extend(
            (r.req_id, r.num_output_tokens, list(r.spec_token_ids))
            for r in running
            if r.spec_token_ids
        )

    monkeypatch.setattr(decoder, "propose", spy)
    return seen


class OracleProposer:
    """Drafts the reference run's next tokens (looked up by prompt), with ``bad`` put in at
    draft position 2 of constrained requests when given: the drafts are then exactly what
    greedy decoding emits, up to that token."""

    needs_slots = False

    def __init__(self, outputs, bad: int | None = None) -> None:
        self.continuations = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
        self.bad = bad

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        drafts = []
        for request, n in zip(requests, num_tokens, strict=True):
            ref = self.continuations[tuple(request.prompt_token_ids)]
            out = request.output_token_ids
            draft = list(ref[len(out) : len(out) + n]) if ref[: len(out)] == out else []
            grammar = request.params.structured_outputs is not None
            if self.bad is not None and grammar and len(draft) > 2:
                draft[2] = self.bad
            drafts.append(draft)
        return drafts

    def observe(self, step, hidden, result) -> None:
        pass

    def release(self, req_id: str) -> None:
        pass


class FixedProposer(OracleProposer):
    """Drafts the same tokens after every request's last token."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [self.draft[:n] for n in num_tokens]


# -- the verify step's bitmask rows -----------------------------------------------------------


def test_draft_bitmasks_equal_fresh_matchers_at_each_prefix(spec):
    """Row i of a draft's bitmasks is the mask of a fresh matcher that consumed the first i
    drafts; the draft is cut where a fresh matcher stops consuming; the request's matcher ends
    where it began; EOS is allowed only where the JSON is complete."""
    engine = spec.engine
    compiler = engine.structured.compiler
    manager = StructuredOutputManager(compiler)
    params = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    manager.add("r", params)
    while not manager.status("r", [])[0]:
        manager.wait_for_compiles(0.1)
    text_ids = engine.tokenizer.encode('{"name":"Ann","age":7}')
    eos = engine.tokenizer.eos_token_id
    draft = text_ids + [eos, text_ids[0]]

    template = compiler.compile(params)
    fresh_length = 0
    for i in range(1, len(draft) + 1):
        if not template.matcher().consume_tokens(draft[:i]):
            break
        fresh_length = i
    assert fresh_length == len(text_ids) + 1  # the JSON, then EOS; nothing after EOS
    assert manager.valid_draft_length("r", draft) == fresh_length
    assert manager.valid_draft_length("r", [eos]) == 0  # an empty object is not a PERSON

    valid = draft[: len(text_ids)]
    rows = manager.draft_bitmasks({"r": valid, "free": [1, 2]})
    assert list(rows) == ["r"] and rows["r"].shape[0] == len(valid) + 1
    assert torch.equal(manager.draft_bitmasks({"r": []})["r"], rows["r"][:1])
    expected = llguidance.torch.allocate_token_bitmask(len(valid) + 1, compiler.vocab_size)
    for i in range(len(valid) + 1):
        matcher = template.matcher()
        assert matcher.consume_tokens(valid[:i]) or i == 0
        llguidance.torch.fill_next_token_bitmask(matcher, expected, i)
    assert torch.equal(rows["r"], expected)
    eos_allowed = [bool((int(row[eos // 32]) >> (eos % 32)) & 1) for row in rows["r"]]
    assert eos_allowed == [False] * len(valid) + [True]
    # The request's own matcher is where it began: its next row is the first one again.
    assert torch.equal(manager.bitmask(["r"])["r"].get(), expected[0])
    manager.release("r")


# -- greedy: the tokens of the engine without speculation -------------------------------------


def test_constrained_greedy_output_equals_no_speculation(spec, reference, monkeypatch):
    """json_schema, regex and choice rows beside free rows, n-gram drafts: every row's tokens
    are the engine's without speculation, logprobs agree, the constrained texts validate, and
    the constrained rows did speculate."""
    drafts = record_drafts(spec, monkeypatch)
    before = spec.engine.stats().spec_decode
    outputs = spec.chat(CONVS, GREEDY)
    assert tokens_of(outputs) == tokens_of(reference)
    check_constrained_texts(outputs)
    for row in (0, 3):
        assert max_logprob_diff(outputs[row].outputs[0], reference[row].outputs[0]) < LOGPROB_TOL
    json_id = outputs[0].request_id
    assert any(req_id == json_id for req_id, _, _ in drafts)
    after = spec.engine.stats().spec_decode
    assert after.num_accepted_tokens > before.num_accepted_tokens
    assert_idle(spec)


def test_drafts_are_cut_where_the_grammar_rejects_them(spec, reference, monkeypatch):
    """Drafts of the reference's own tokens with EOS put in at position 2 (never allowed
    inside an unfinished JSON array, date or colour): each constrained draft reaches the
    scheduler cut before it, so every draft is accepted (the per-position bitmasks pick the
    reference's tokens) and the output is the reference's."""
    eos = spec.engine.tokenizer.eos_token_id
    monkeypatch.setattr(spec.engine.spec, "proposer", OracleProposer(reference, bad=eos))
    drafts = record_drafts(spec, monkeypatch)
    before = spec.engine.stats().spec_decode
    outputs = spec.chat(CONVS, GREEDY)
    assert tokens_of(outputs) == tokens_of(reference)
    check_constrained_texts(outputs)
    after = spec.engine.stats().spec_decode
    num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    assert after.num_accepted_tokens - before.num_accepted_tokens == num_draft_tokens > 0
    ids = {o.request_id: r.outputs[0].token_ids for o, r in zip(outputs, reference, strict=True)}
    constrained_ids = {o.request_id for o in outputs[:3]}
    cut = 0
    for req_id, num_out, draft in drafts:
        assert draft == ids[req_id][num_out : num_out + len(draft)]
        if req_id in constrained_ids:
            # Past position 1 only where the reference itself ends (EOS allowed there).
            assert len(draft) <= 2 or draft[2:] == [eos]
            cut += len(draft) == 2
    assert cut > 0
    assert_idle(spec)


def test_a_draft_model_drafts_are_cut_and_their_kv_trimmed(tiny_llama_path, monkeypatch):
    """A draft model that is the target itself drafts the target's unmasked greedy tokens: cut
    at the first one the grammar refuses, the rest are all accepted (the masked argmax of the
    rows before it); greedy tokens equal the engine's without speculation, and the KV blocks
    drafted past a cut come back."""
    args = dict(model=str(tiny_llama_path), max_model_len=256, num_kv_blocks=64)
    prompts = [[11, 12, 13, 14] * 4, [300, 301, 302], [7, 8, 9, 10, 11], [21, 22, 23] * 3]
    params = [
        constrained(max_tokens=24, regex="[a-z]{3,12}( [a-z]{2,9}){0,5}"),
        constrained(max_tokens=24, json=PERSON),
        constrained(max_tokens=8, choice=COLOURS),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    expected = LLM(**args).generate(prompts, params)
    speculative = {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "model": args["model"],
        "min_acceptance_rate": 0.0,
    }
    llm = LLM(**args, speculative_config=speculative)
    drafts = record_drafts(llm, monkeypatch)
    outputs = llm.generate(prompts, params)
    assert tokens_of(outputs) == tokens_of(expected)
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # Cut by the grammar, not by max_tokens: the regex and JSON rows had room for 4 drafts.
    cut_rows = {o.request_id for o in outputs[:2]}
    assert any(r in cut_rows and len(d) < 4 and n + 5 <= 24 for r, n, d in drafts)
    assert_idle(llm)


# -- stop strings and logprobs ----------------------------------------------------------------


def test_stop_strings_and_logprobs_match_no_speculation(plain, spec, reference, monkeypatch):
    """Drafts of the reference's tokens are all accepted, so stop strings land inside accepted
    runs: the text is cut at the same place, the tokens after the one completing the stop
    string are dropped, and logprobs (one entry per token) agree with the engine's without
    speculation."""
    free = reference[3].outputs[0]
    words = free.text.split()
    stop_at = [words[len(words) // 2], words[-3] + " " + words[-2]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, stop=[stop_at[0]], logprobs=1),
        SamplingParams(
            temperature=0.0, max_tokens=32, stop=[stop_at[1]], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0.0, max_tokens=32, stop=["no such text"], logprobs=2),
    ]
    convs = [ask(REPEAT)] * 3
    expected = plain.chat(convs, params)
    monkeypatch.setattr(spec.engine.spec, "proposer", OracleProposer(reference[3:4]))
    before = spec.engine.stats().spec_decode
    outputs = spec.chat(convs, params)
    after = spec.engine.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 2 * len(params)
    for got, want in zip(outputs, expected, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids,
            w.text,
            w.finish_reason,
            w.stop_reason,
        )
    assert outputs[0].outputs[0].stop_reason == stop_at[0]
    assert len(outputs[0].outputs[0].token_ids) < len(free.token_ids)
    for row in (0, 2):
        g, w = outputs[row].outputs[0], expected[row].outputs[0]
        assert max_logprob_diff(g, w) < LOGPROB_TOL
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert_idle(spec)


# -- sampled: the acceptance rule on masked distributions --------------------------------------


def test_rejection_sampling_keeps_a_grammar_masked_distribution():
    """Drafts the grammar allows, verified against bitmask-masked target rows: the first
    emitted token follows the masked distribution (chi-square, p = 0.001), the second follows
    its own row's mask, and masked tokens never come out."""
    vocab = 8
    logits = torch.tensor(
        [
            [1.0, 2.0, 0.5, 0.0, 1.5, -1.0, 0.3, 0.8],
            [0.2, 0.0, 1.5, -0.5, 1.0, 0.1, 2.0, 0.4],
            [0.0] * vocab,
        ]
    )
    allowed = [[0, 2, 3, 5, 6], [1, 2, 4, 6], [3, 7]]  # per position, as a grammar's rows
    bitmask = torch.tensor([[sum(1 << t for t in row)] for row in allowed], dtype=torch.int32)
    masked = apply_token_bitmask(logits, bitmask)
    batch = SamplingBatch(
        temperature=torch.ones(3),
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        min_p=torch.zeros(3),
        generators=[None] * 3,
    )
    probs = target_probs(masked, batch)
    # A fresh computation of the masked distributions: softmax over the allowed tokens.
    fresh = torch.zeros(3, vocab)
    for i, row in enumerate(allowed):
        weights = logits[i, row].exp()
        fresh[i, row] = weights / weights.sum()
    assert torch.allclose(probs, fresh, atol=1e-6)
    draft = [2, 6]  # allowed at positions 0 and 1
    gen = torch.Generator().manual_seed(99)
    trials = 8000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(trials):
        tokens = rejection_sample(probs, draft, gen)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    assert set(first) <= set(allowed[0]) and set(second) <= set(allowed[1])
    for counts, row, p in ((first, allowed[0], fresh[0]), (second, allowed[1], fresh[1])):
        total = sum(counts.values())
        chi2 = sum((counts[t] - total * float(p[t])) ** 2 / (total * float(p[t])) for t in row)
        critical = {3: 16.27, 4: 18.47}[len(row) - 1]
        assert chi2 < critical, (chi2, counts)


def test_sampled_grammar_outputs_follow_the_distribution_without_speculation(
    tiny_llama_path, monkeypatch
):
    """Temperature 1 under the regex [ab]{3} on a tiny random model: the texts with drafts
    "a", "b", "a" (verified on rows masked after each draft prefix) follow the same
    distribution as without speculation (two-sample chi-square, p = 0.001). Unseeded requests
    (a seeded one draws its noise row by row) from a seeded global generator."""
    torch.manual_seed(0)
    args = dict(model=str(tiny_llama_path), max_model_len=64, num_kv_blocks=200, max_num_seqs=128)
    num = 480
    regex = StructuredOutputsParams(regex="[ab]{3}")
    params = SamplingParams(temperature=1.0, max_tokens=6, structured_outputs=regex)
    prompts = [[7, 8, 9, 10]] * num
    plain = Counter(o.outputs[0].text for o in LLM(**args).generate(prompts, params))
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    llm = LLM(**args, speculative_config=speculative)
    a, b = llm.engine.tokenizer.encode("a"), llm.engine.tokenizer.encode("b")
    monkeypatch.setattr(llm.engine.spec, "proposer", FixedProposer(a + b + a))
    spec = Counter(o.outputs[0].text for o in llm.generate(prompts, params))
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes happen
    assert all(re.fullmatch("[ab]{3}", text) for text in plain | spec)
    texts = sorted(plain | spec)
    chi2 = sum((plain[t] - spec[t]) ** 2 / (plain[t] + spec[t]) for t in texts)
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
    assert chi2 < critical[len(texts) - 1], (plain, spec)
    assert_idle(llm)


def test_sampled_constrained_requests_speculate_validate_and_repeat(spec, monkeypatch):
    """Temperature 1 with seeds: drafts are verified on masked distributions, every output
    validates, and the same seeds give the same tokens again."""
    params = [
        constrained(1.0, 72, json=PEOPLE),
        constrained(1.0, 12, regex=DATE),
        constrained(1.0, 8, choice=COLOURS),
    ]
    drafts = record_drafts(spec, monkeypatch)
    first = spec.chat(CONVS[:3], params)
    check_constrained_texts(first)
    assert {req_id for req_id, _, _ in drafts} & {o.request_id for o in first}
    again = spec.chat(CONVS[:3], params)
    assert tokens_of(again) == tokens_of(first)
    assert_idle(spec)
