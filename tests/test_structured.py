"""Grammar-constrained decoding in the engine: the bitmask function, the compiler and its
cache, EOS, the scheduler's wait for compiles, and constrained generation end to end.

References are independent of the code under test: a boolean mask built token by token,
Python's ``json``/``re``/``jsonschema`` on the text, and the same free requests run without
constrained neighbours.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputManager,
    StructuredOutputsParams,
    apply_grammar_bitmasks,
    apply_token_bitmask,
)
from neuron_runtime.structured_output.bitmask import BitmaskRow
from neuron_runtime.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

MAX_MODEL_LEN = 512
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def constrained(temperature: float = 0.0, max_tokens: int = 64, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=None if temperature == 0 else 11,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_used == 0 and stats.num_grammar_states == 0


# -- the bitmask as a pure tensor function --------------------------------------------------


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word, bit = divmod(token, 32)
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> bit) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 100, 130])
def test_apply_token_bitmask_equals_a_token_by_token_mask(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [4, 0, 2]
    got = apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(got, reference_mask(logits, bitmask, rows))
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # other rows bit for bit
    # A full-batch bitmask with all-ones rows (the static-shape form) changes only its rows.
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[rows] = bitmask
    assert torch.equal(apply_token_bitmask(logits, full), got)
    # Fewer words than the vocabulary needs: the tokens past them are not allowed.
    short = apply_token_bitmask(logits, bitmask[:, :1], torch.tensor(rows))
    assert torch.isinf(short[rows, 32:]).all()
    filled: Future[None] = Future()
    filled.set_result(None)
    row = [BitmaskRow(bitmask, i, filled) for i in range(3)]
    per_row = apply_grammar_bitmasks(logits, [row[1], None, row[2], None, row[0]])
    assert torch.equal(per_row, got)


# -- compiler, cache, EOS -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf_tokenizer, 49152, tokenizer.eos_token_id)


def test_params_take_exactly_one_constraint_and_name_bad_fields():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams.from_dict({"choice": ["a", "b"]}).choice == ("a", "b")
    cases = [
        (dict(), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(json="{not json"), "json is not valid JSON"),
        (dict(json="[1]"), "json must be"),
        (dict(choice=[]), "choice must be"),
        (dict(regex=""), "regex must be"),
        (dict(regex="a", whitespace_pattern=" "), "whitespace_pattern"),
        (dict(regex="a" * 300_000), "at most"),
    ]
    for fields, needle in cases:
        with pytest.raises(ValueError, match=needle):
            StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match="does not support backend"):
        StructuredOutputsParams.from_dict({"regex": "a", "backend": "x"})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})


def test_compile_is_cached_by_content_and_bad_grammars_raise(compiler):
    one = compiler.submit(StructuredOutputsParams(json={"type": "object"}))
    again = compiler.submit(StructuredOutputsParams(json='{"type": "object"}'))
    assert one is again
    assert one.future.result(timeout=30).matcher() is not None
    bad = [
        dict(json={"type": "objectx"}),
        dict(json={"type": "string", "pattern": "(unclosed"}),
        dict(regex="(ab"),
        dict(grammar="start: undefined_rule"),
        dict(grammar="root ::= ("),
    ]
    for fields in bad:
        with pytest.raises(GrammarError, match="invalid"):
            compiler.submit(StructuredOutputsParams(**fields)).future.result(timeout=30)


def allowed(row: BitmaskRow, token: int) -> bool:
    return bool((int(row.get()[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize(
    "fields, text, complete",
    [
        (
            dict(json=PERSON, disable_any_whitespace=True),
            '{"name":"Al","age":42,"tags":["a","c"]}',
            lambda t: _valid_json(t, PERSON),
        ),
        (dict(regex=r"[0-9]{2,4}-x?"), "1234-x", lambda t: re.fullmatch(r"[0-9]{2,4}-x?", t)),
        (dict(choice=["yes", "yesterday"]), "yesterday", lambda t: t in ("yes", "yesterday")),
    ],
)
def test_eos_is_allowed_exactly_when_the_text_is_complete(
    compiler, tokenizer, fields, text, complete
):
    manager = StructuredOutputManager(compiler)
    manager.add("r", StructuredOutputsParams(**fields))
    deadline = time.monotonic() + 30
    while not manager.status("r", [])[0]:
        assert manager.status("r", [])[1] is None and time.monotonic() < deadline
        manager.wait_for_compiles(0.1)
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    for i in range(len(ids) + 1):
        row = manager.bitmask(["r", "unconstrained"])["r"]
        prefix = tokenizer.decode(ids[:i])
        assert allowed(row, eos) == bool(complete(prefix)), prefix
        if i < len(ids):
            assert allowed(row, ids[i])
            assert manager.accept("r", ids[i])
    manager.release("r")
    assert manager.num_states == 0


def test_the_mask_fills_on_its_thread_and_matchers_wait_for_the_fill(
    compiler, tokenizer, monkeypatch
):
    """bitmask() returns while the fill runs (the step's forward pass goes on meanwhile); the
    sampler's get() and any change to a matcher wait for it."""
    import llguidance.torch

    real_fill = llguidance.torch.fill_next_token_bitmask_par
    go, fill_threads = threading.Event(), []

    def held_fill(*args):
        fill_threads.append(threading.current_thread().name)
        go.wait(timeout=30)
        return real_fill(*args)

    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask_par", held_fill)
    manager = StructuredOutputManager(compiler)
    manager.add("r", StructuredOutputsParams(regex="[0-9]{3}"))
    while not manager.status("r", [])[0]:
        manager.wait_for_compiles(0.1)
    row = manager.bitmask(["r"])["r"]
    assert not row.filled.done()
    (digit,) = tokenizer.encode("7", add_special_tokens=False)
    accepted: list[bool] = []
    accepting = threading.Thread(target=lambda: accepted.append(manager.accept("r", digit)))
    accepting.start()
    accepting.join(timeout=0.2)
    assert accepting.is_alive() and not accepted, "accept() changed a matcher mid-fill"
    go.set()
    accepting.join(timeout=30)
    assert accepted == [True]
    assert fill_threads and fill_threads[0].startswith("grammar-bitmask")
    assert fill_threads[0] != threading.current_thread().name
    (letter,) = tokenizer.encode("a", add_special_tokens=False)
    assert allowed(row, digit) and not allowed(row, letter)
    assert not allowed(row, tokenizer.eos_token_id)
    manager.release("r")
    assert manager.num_states == 0


def _valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# -- constrained generation in the engine ---------------------------------------------------


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(model=str(default_model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)


def test_json_regex_choice_outputs_match_their_constraint(llm):
    params = [
        constrained(1.0, 96, json=PERSON),
        constrained(0.0, 96, json=PERSON),
        constrained(1.0, 96, json_object=True, whitespace_pattern=r"[ ]?"),
        constrained(1.0, 16, regex=r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        constrained(1.0, 16, choice=["red", "green", "blue", "light blue"]),
        constrained(1.0, 64, grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]{1,5}/'),
    ]
    outs = llm.chat([ASK] * len(params), params)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    jsonschema.validate(json.loads(texts[0]), PERSON)
    jsonschema.validate(json.loads(texts[1]), PERSON)
    assert isinstance(json.loads(texts[2]), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", texts[3])
    assert texts[4] in ("red", "green", "blue", "light blue")
    assert re.fullmatch(r"\([a-z]{1,5}(,[a-z]{1,5})*\)", texts[5])
    assert_idle(llm)


def test_the_static_sampler_masks_as_the_eager_sampler(compiler, tokenizer):
    """The static runner's sampler inputs (backends/static/sampler.py) carry each constrained
    row's bitmask as -inf in its bias; on the same logits its greedy graph function picks the
    eager path's tokens, which the grammar allows, and a free row is left alone."""
    from neuron_runtime.backends.static.sampler import greedy_tokens, sampling_inputs
    from neuron_runtime.sampler import SamplingBatch
    from neuron_runtime.scheduler import ScheduledSeq

    manager = StructuredOutputManager(compiler)
    kinds = {"digits": dict(regex="[0-9]{2,4}"), "colour": dict(choice=["red", "blue"])}
    for req_id, kind in kinds.items():
        manager.add(req_id, StructuredOutputsParams(**kind))
    while not all(manager.status(r, [])[0] for r in kinds):
        manager.wait_for_compiles(0.1)
    rows = manager.bitmask(["digits", "free", "colour"])
    params = SamplingParams(temperature=0.0)
    seqs = [
        ScheduledSeq(r, [1], 0, [0], True, params, grammar_bitmask=rows.get(r))
        for r in ("digits", "free", "colour")
    ]
    vocab = compiler.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    zeros = torch.zeros(3)
    batch = SamplingBatch(zeros, zeros.long(), zeros + 1, zeros, [None] * 3)
    inputs = sampling_inputs(seqs, batch, vocab, torch.device("cpu"))
    eager = apply_grammar_bitmasks(logits, [s.grammar_bitmask for s in seqs])
    assert torch.equal(torch.isfinite(inputs.bias), torch.isfinite(eager))
    assert torch.equal(inputs.bias[1], torch.zeros(vocab))
    tokens = greedy_tokens(logits, inputs.bias).tolist()
    assert tokens == eager.argmax(dim=-1).tolist()
    assert tokens[1] == int(logits[1].argmax())
    assert tokenizer.decode([tokens[0]]).isdigit()
    assert any(c.startswith(tokenizer.decode([tokens[2]])) for c in ("red", "blue"))
    for req_id in kinds:
        manager.release(req_id)


def test_free_rows_of_a_mixed_batch_get_the_same_tokens_as_alone(llm):
    free = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24),
    ]
    prompts = ["The capital of France is", "Once upon a time,"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    mixed_params = [free[0], constrained(json=PERSON), free[1], constrained(1.0, regex="[a-z]+")]
    mixed_prompts = [prompts[0], "A person:", prompts[1], "A word:"]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert_idle(llm)


def test_n_samples_and_preemption_keep_each_sequence_on_its_grammar(default_model_path):
    params = constrained(1.0, 48, json=PERSON).replace(n=3)
    roomy = LLM(model=str(default_model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)
    (reference,) = roomy.chat(ASK, params)
    # 40 blocks of 16 tokens for 8 requests of ~40-token prompts + 48 outputs: preemptions.
    tight = LLM(model=str(default_model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=40)
    outs = tight.chat([ASK] * 8, [params] * 8)
    assert tight.engine.stats().num_preemptions > 0
    for out in [reference, *outs]:
        for seq in out.outputs:
            jsonschema.validate(json.loads(seq.text), PERSON)
    # Seeded: a preempted and recomputed request samples the same tokens as an unhurried one.
    assert [s.token_ids for s in outs[-1].outputs] == [s.token_ids for s in reference.outputs]
    assert_idle(tight)


def test_a_compiling_grammar_waits_without_blocking_others(llm, monkeypatch):
    compiler = llm.engine.structured.compiler
    release = threading.Event()
    real_compile = compiler.compile

    def slow_compile(params):
        release.wait(timeout=30)
        return real_compile(params)

    monkeypatch.setattr(compiler, "compile", slow_compile)
    engine = llm.engine
    engine.add_request("held", "A number:", constrained(regex="4[0-9]{2}"))
    engine.add_request("free", "The capital of France is", SamplingParams(max_tokens=6))
    finished = {}
    while "free" not in finished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "held" not in finished and engine.stats().num_waiting == 1
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert re.fullmatch("4[0-9]{2}", finished["held"].outputs[0].text)
    assert_idle(llm)


def test_failed_slow_and_unsatisfiable_grammars_end_only_their_request(llm, monkeypatch):
    engine = llm.engine
    free = SamplingParams(temperature=0, max_tokens=8)
    (reference,) = llm.generate("Water boils at", free)
    compiler = engine.structured.compiler
    real_compile = compiler.compile
    monkeypatch.setattr(compiler, "timeout_s", 0.3)

    def compile_or_hang(params):
        if params.regex == "hang":
            time.sleep(1.0)
        return real_compile(params)

    monkeypatch.setattr(compiler, "compile", compile_or_hang)
    cases = {
        "bad": constrained(json={"type": "objectx"}),
        "hang": constrained(regex="hang"),
        # Every token the grammar allows is outside allowed_token_ids.
        "empty": constrained(regex="[0-9]+").replace(allowed_token_ids=[28]),
    }
    outs = llm.generate(["Water boils at", *["x"] * len(cases)], [free, *cases.values()])
    assert outs[0].outputs[0].token_ids == reference.outputs[0].token_ids
    errors = [o.error for o in outs[1:]]
    assert "objectx" in errors[0]
    assert "did not compile within 0.3 s" in errors[1]
    assert "no token the grammar allows" in errors[2]
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:])
    assert_idle(llm)


def test_an_unconstrained_engine_never_imports_the_grammar_engines_torch_part(
    default_model_path,
):
    """``llguidance.torch`` takes seconds to import (torch's compiler stack): an engine whose
    requests carry no constraint must not pay it in its first step. A fresh interpreter, so
    other tests' imports do not count."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from neuron_runtime import LLM, SamplingParams\n"
        f"llm = LLM(model={str(default_model_path)!r}, max_model_len=128, num_kv_blocks=16)\n"
        "out = llm.generate(['Hello'], SamplingParams(temperature=0, max_tokens=3))\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "print(sorted(m for m in sys.modules if m.startswith('llguidance')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    imported = done.stdout.strip().splitlines()[-1]
    assert "llguidance.torch" not in imported, imported
