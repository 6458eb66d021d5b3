"""Grammar-constrained decoding: per-token overhead against free decoding, and compile time.

Offline engine, default model (SmolLM2-135M, 49,152-token vocabulary), fp32, 1 torch thread.
Each batch (1 and 32) runs the same prompts free (ignore_eos) and constrained, alternating
free and constrained runs within each round; the grammars cannot end before ``--tokens``
tokens, so every run produces exactly that many. Greedy (temperature 0) runs, each
constraint two ways:

- as the engine runs it here (the kernels take every core): rows sampled unmasked, each
  pick checked by its matcher, a bitmask row filled and applied only where the grammar
  refuses the pick or forces bytes;
- ``fill ahead``: every row's bitmask filled on the grammar manager's thread while the
  forward pass runs (what the engine does where a core is free), picks checked on its bits.

Both must give the same tokens (checked). Then sampled runs (temperature 1, seeded), free
against constrained: a sampled row is masked before it samples (every row filled and
applied each step).
Per-token time = (time for N tokens - time for 1 token) / (N - 1), which leaves the prompt
out; wall time, or with ``--clock cpu`` the CPU time of the whole process (every thread: a
fill thread's work counts). Constraints:

- ``regex``: ``([a-z]+ ){N,}`` words (free text inside a grammar);
- ``json``: a JSON array of at least N strings;
- ``json bounded``: the same with 2-12 characters per string (``minLength``/``maxLength``
  are outside llguidance's precomputed token sets for JSON strings: each mask costs more).

Then the cost of its parts at batch 1 and 32 (mask fill by llguidance for every row, the
bitmask applied to the logits, and the check of each row's pick without a mask), and
compile time: the first compile of each schema (its own cache key) and a
cache hit.

``--compare-xgrammar`` (needs ``pip install xgrammar``, not a dependency) compares the two
grammar engines on their own: compile time of each schema and the time to fill one token
mask at every position of a valid answer, on the same tokenizer.

    python bench/structured.py [--repeats 3] [--tokens 64] [--batch-sizes 1 32]
        [--engine-threads N] [--clock wall|cpu] [--compare-xgrammar]
        [--json bench/results/structured.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.structured_output import (
    GrammarCompiler,
    StructuredOutputManager,
    StructuredOutputsParams,
    apply_grammar_bitmasks,
)
from neuron_runtime.structured_output.bitmask import fix_greedy_tokens

PROMPT = "Write a list of {i} words about the sea:"
COMPILE_SCHEMAS = {
    "flat object": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    "nested + arrays + enums": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                    "score": {"type": "number", "minimum": -1.5, "maximum": 99.5},
                },
                "required": ["id", "tags"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user"],
    },
    "40 properties": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(40)},
        "required": [f"field_{i}" for i in range(40)],
    },
    "enum of 5,000": {"enum": [f"value number {i}" for i in range(5000)]},
}


def constraints(tokens: int) -> dict[str, StructuredOutputsParams]:
    return {
        "regex": StructuredOutputsParams(regex=f"([a-z]+ ){{{tokens},}}"),
        "json": StructuredOutputsParams(
            json={"type": "array", "items": {"type": "string"}, "minItems": tokens},
            disable_any_whitespace=True,
        ),
        "json bounded": StructuredOutputsParams(
            json={
                "type": "array",
                "items": {"type": "string", "minLength": 2, "maxLength": 12},
                "minItems": tokens,
            },
            disable_any_whitespace=True,
        ),
    }


# The decode runs' clock: wall time, or with --clock cpu the CPU time of every thread of this
# process (on a box shared with other jobs, what they take from it stays out of the figure).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = clock()
    outs = llm.generate(prompts, params)
    elapsed = clock() - start
    for out in outs:
        assert len(out.outputs[0].token_ids) == params.max_tokens, out.outputs[0].finish_reason
    return elapsed


def per_token(llm: LLM, prompts: list[str], params: SamplingParams, tokens: int) -> float:
    """(time for N tokens - time for 1 token) / (N - 1), in seconds."""
    full = timed(llm, prompts, params.replace(max_tokens=tokens))
    first = timed(llm, prompts, params.replace(max_tokens=1))
    return (full - first) / (tokens - 1)


@contextmanager
def fill_ahead(llm: LLM) -> Iterator[None]:
    """Every bitmask row filled on the grammar manager's thread during the forward pass."""
    manager = llm.engine.structured
    default, manager.fill_ahead = manager.fill_ahead, True
    try:
        yield
    finally:
        manager.fill_ahead = default


def decode_overhead(llm: LLM, batch: int, tokens: int, repeats: int) -> dict:
    prompts = [PROMPT.format(i=i) for i in range(batch)]
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=1, ignore_eos=True)
    kinds = constraints(tokens)
    runs: dict[str, list[float]] = {"free": [], "free sampled": []}
    for kind in kinds:
        runs[kind] = []
        runs[f"{kind} fill ahead"] = []
        runs[f"{kind} sampled"] = []
    per_token(llm, prompts, greedy, 4)  # warm up (kernels, caches)
    for params in kinds.values():  # compile once: the timed runs hit the cache
        per_token(llm, prompts, SamplingParams(temperature=0, structured_outputs=params), 4)
    for _ in range(repeats):
        runs["free"].append(per_token(llm, prompts, greedy, tokens))
        for kind, params in kinds.items():
            constrained = SamplingParams(temperature=0, structured_outputs=params)
            runs[kind].append(per_token(llm, prompts, constrained, tokens))
            with fill_ahead(llm):
                runs[f"{kind} fill ahead"].append(per_token(llm, prompts, constrained, tokens))
        runs["free sampled"].append(per_token(llm, prompts, sampled, tokens))
        for kind, params in kinds.items():
            constrained = SamplingParams(temperature=1.0, seed=1, structured_outputs=params)
            runs[f"{kind} sampled"].append(per_token(llm, prompts, constrained, tokens))
    for kind, params in kinds.items():  # the two ways of filling give the same tokens
        constrained = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=params)
        on_demand = [o.outputs[0].token_ids for o in llm.generate(prompts, constrained)]
        with fill_ahead(llm):
            ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, constrained)]
        assert on_demand == ahead, kind
    medians = {k: statistics.median(v) for k, v in runs.items()}

    def base(k: str) -> float:
        return medians["free sampled" if k.endswith("sampled") else "free"]

    return {
        "batch": batch,
        "per_token_ms": {k: 1e3 * v for k, v in medians.items()},
        "overhead": {k: medians[k] / base(k) - 1 for k in runs if not k.startswith("free")},
        "runs_ms": {k: [1e3 * x for x in v] for k, v in runs.items()},
    }


def parts_at_batch(llm: LLM, batch: int, kind: str, steps: int = 48) -> dict:
    """Per step, with every row of the batch stepping through the same valid answer: the mask
    fill for every row (llguidance, one call for the batch, timed to completion), that
    bitmask applied to [B, V] logits, and the check of each row's pick without a mask (rows
    filled on demand; logits whose argmax is the answer's token, so no row is masked)."""
    compiler = llm.engine.structured.compiler
    ahead = StructuredOutputManager(compiler)
    on_demand = StructuredOutputManager(compiler, fill_ahead=False)
    params = constraints(steps)[kind]
    ids = [f"r{i}" for i in range(batch)]
    for manager in (ahead, on_demand):
        for req_id in ids:
            manager.add(req_id, params)
        while not all(manager.status(r, [])[0] for r in ids):
            manager.wait_for_compiles(0.1)
    words = [chr(97 + i % 26) + chr(97 + i // 26) for i in range(steps)]
    text = " ".join(words) + " " if kind == "regex" else json.dumps(words, separators=(",", ":"))
    tokens = llm.get_tokenizer().encode(text, add_special_tokens=False)[:steps]
    logits = torch.randn(batch, llm.engine.config.model.vocab_size)
    fill, apply, check, masked = [], [], [], 0
    for token in tokens:
        start = time.perf_counter()
        rows = ahead.bitmask(ids)
        rows[ids[0]].get()  # the fill runs on the manager's thread: wait for it
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_grammar_bitmasks(logits, [rows[r] for r in ids])
        apply.append(time.perf_counter() - start)
        picks = torch.full((batch,), token)
        start = time.perf_counter()
        rows = on_demand.bitmask(ids)
        fixed = fix_greedy_tokens(logits, picks, [rows[r] for r in ids])
        check.append(time.perf_counter() - start)
        assert torch.equal(fixed, picks)
        masked += sum(rows[r].filled.done() for r in ids)  # filled: forced bytes
        for manager in (ahead, on_demand):
            for req_id in ids:
                assert manager.accept(req_id, token)
    for manager in (ahead, on_demand):
        for req_id in ids:
            manager.release(req_id)
    return {
        "batch": batch,
        "kind": kind,
        "mask_fill_ms": 1e3 * statistics.median(fill),
        "bitmask_apply_ms": 1e3 * statistics.median(apply),
        "check_ms": 1e3 * statistics.median(check),
        "rows_filled_by_check": masked / (batch * len(tokens)),
    }


def fill_beside_a_forward(llm: LLM, batch: int = 32, steps: int = 30) -> dict:
    """Whether a fill hides behind work on another thread: one step's mask fill for ``batch``
    regex rows (on the manager's thread, as the engine runs it) and a stand-in for the
    forward pass (three [batch, 576] x [576, V] products, one torch thread), timed apart,
    one after the other and concurrently; medians over ``steps`` positions of an answer."""
    manager = StructuredOutputManager(llm.engine.structured.compiler)
    ids = [f"r{i}" for i in range(batch)]
    for req_id in ids:
        manager.add(req_id, constraints(steps)["regex"])
    while not all(manager.status(r, [])[0] for r in ids):
        manager.wait_for_compiles(0.1)
    words = [chr(97 + i % 26) + chr(97 + i // 26) for i in range(4 * steps)]
    tokens = iter(llm.get_tokenizer().encode(" ".join(words) + " ", add_special_tokens=False))
    hidden, head = torch.randn(batch, 576), torch.randn(576, llm.engine.config.model.vocab_size)

    def forward() -> None:
        for _ in range(3):
            hidden @ head

    def fill_then_step(rows: dict) -> None:
        rows[ids[0]].get()
        token = next(tokens)
        for req_id in ids:
            assert manager.accept(req_id, token)

    times: dict[str, list[float]] = {"fill": [], "forward": [], "sequential": [], "overlapped": []}
    for _ in range(steps // 3):
        start = time.perf_counter()
        fill_then_step(manager.bitmask(ids))
        times["fill"].append(time.perf_counter() - start)
        start = time.perf_counter()
        forward()
        times["forward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        rows = manager.bitmask(ids)
        rows[ids[0]].get()
        forward()
        fill_then_step(rows)
        times["sequential"].append(time.perf_counter() - start)
        start = time.perf_counter()
        rows = manager.bitmask(ids)
        forward()
        fill_then_step(rows)
        times["overlapped"].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def compile_times(llm: LLM) -> dict:
    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.config.model.vocab_size
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, vocab, tokenizer.eos_token_id)
    start = time.perf_counter()
    compiler.ll_tokenizer()
    out = {"token table (once per tokenizer)": time.perf_counter() - start}
    for name, schema in COMPILE_SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        compiler.submit(params).future.result()
        out[name] = time.perf_counter() - start
    params = StructuredOutputsParams(json=COMPILE_SCHEMAS["flat object"])
    start = time.perf_counter()
    compiler.submit(params).future.result()
    out["cache hit"] = time.perf_counter() - start
    return {name: 1e3 * seconds for name, seconds in out.items()}


# A valid compact answer per COMPILE_SCHEMAS entry, walked token by token for mask times.
ANSWERS = {
    "flat object": {"name": "Alice Smith", "age": 42},
    "nested + arrays + enums": {"user": {"id": 7, "tags": ["a", "c"], "score": 12.25}, "ok": True},
    "40 properties": {f"field_{i}": [i, None, "x"][i % 3] for i in range(40)},
    "enum of 5,000": "value number 4321",
}


def compare_engines(llm: LLM) -> dict:
    """llguidance vs xgrammar: compile ms and median / max mask-fill us per token."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import xgrammar

    hf = llm.get_tokenizer().hf_tokenizer
    vocab = llm.engine.config.model.vocab_size
    out: dict = {"llguidance": {}, "xgrammar": {}}
    start = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out["llguidance"]["token table ms"] = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    xg_info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    xg = xgrammar.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)
    out["xgrammar"]["token table ms"] = 1e3 * (time.perf_counter() - start)
    for name, schema in COMPILE_SCHEMAS.items():
        ids = hf.encode(json.dumps(ANSWERS[name], separators=(",", ":")), add_special_tokens=False)
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        compile_s = time.perf_counter() - start
        mask = llguidance.numpy.allocate_token_bitmask(1, vocab)
        fills = []
        for token in ids:
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            fills.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
        out["llguidance"][name] = _engine_row(compile_s, fills)
        start = time.perf_counter()
        compiled = xg.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        xmatcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        xmask = xgrammar.allocate_token_bitmask(1, vocab)
        fills = []
        for token in ids:
            start = time.perf_counter()
            xmatcher.fill_next_token_bitmask(xmask, 0)
            fills.append(time.perf_counter() - start)
            assert xmatcher.accept_token(token)
        out["xgrammar"][name] = _engine_row(compile_s, fills)
    return out


def _engine_row(compile_s: float, fills: list[float]) -> dict:
    return {
        "compile_ms": 1e3 * compile_s,
        "mask_us_median": 1e6 * statistics.median(fills),
        "mask_us_max": 1e6 * max(fills),
    }


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    return {"cpu": model, "load_average": list(Path("/proc/loadavg").read_text().split()[:3])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="the engine's CPU kernel threads (default: every usable core)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    parser.add_argument("--compare-xgrammar", action="store_true")
    parser.add_argument("--json", default="bench/results/structured.json")
    args = parser.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    llm = LLM(
        model="smollm2-135m-instruct",
        max_model_len=512,
        num_kv_blocks=640,
        enable_prefix_caching=False,
        num_threads=args.engine_threads,
    )
    result = {
        "machine_start": machine(),
        "threads": args.threads,
        "engine_threads": args.engine_threads,
        "tokens": args.tokens,
        "clock": args.clock,
    }
    result["compile_ms"] = compile_times(llm)
    if args.compare_xgrammar:
        result["engines"] = compare_engines(llm)
    result["decode"] = [
        decode_overhead(llm, b, args.tokens, args.repeats) for b in args.batch_sizes
    ]
    result["parts"] = [parts_at_batch(llm, b, k) for b in (1, 32) for k in constraints(48)]
    result["fill_beside_forward_ms"] = fill_beside_a_forward(llm)
    result["machine_end"] = machine()

    print(
        f"CPU {result['machine_start']['cpu']}, load {result['machine_start']['load_average']}"
        f" -> {result['machine_end']['load_average']}, {args.threads} thread(s), {args.clock} clock"
    )
    print(
        "\n| batch | constraint | free ms/token | greedy: ms/token (overhead) "
        "| greedy, fill ahead | free sampled ms/token | sampled (overhead) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in result["decode"]:
        ms, over = row["per_token_ms"], row["overhead"]
        for k in constraints(args.tokens):
            ahead, sampled = f"{k} fill ahead", f"{k} sampled"
            print(
                f"| {row['batch']} | {k} | {ms['free']:.2f} | {ms[k]:.2f} ({over[k]:+.1%}) "
                f"| {ms[ahead]:.2f} ({over[ahead]:+.1%}) | {ms['free sampled']:.2f} "
                f"| {ms[sampled]:.2f} ({over[sampled]:+.1%}) |"
            )
    print(
        "\n| batch | constraint | mask fill ms/step | bitmask apply ms/step "
        "| check picks ms/step | rows filled by the check |"
    )
    print("|---|---|---|---|---|---|")
    for row in result["parts"]:
        print(
            f"| {row['batch']} | {row['kind']} | {row['mask_fill_ms']:.3f} "
            f"| {row['bitmask_apply_ms']:.3f} | {row['check_ms']:.3f} "
            f"| {row['rows_filled_by_check']:.0%} |"
        )
    overlap = result["fill_beside_forward_ms"]
    print("\n| batch 32 regex, ms per step | " + " | ".join(overlap) + " |")
    print("|---|" + "---|" * len(overlap))
    print("| median | " + " | ".join(f"{v:.1f}" for v in overlap.values()) + " |")
    print("\n| compile | ms |")
    print("|---|---|")
    for name, ms in result["compile_ms"].items():
        print(f"| {name} | {ms:.1f} |")
    if args.compare_xgrammar:
        print("\n| schema | engine | compile ms | mask us, median | mask us, max |")
        print("|---|---|---|---|---|")
        for name in COMPILE_SCHEMAS:
            for engine in ("llguidance", "xgrammar"):
                row = result["engines"][engine][name]
                print(
                    f"| {name} | {engine} | {row['compile_ms']:.1f} | "
                    f"{row['mask_us_median']:.1f} | {row['mask_us_max']:.1f} |"
                )
        for engine in ("llguidance", "xgrammar"):
            print(f"token table, {engine}: {result['engines'][engine]['token table ms']:.0f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
