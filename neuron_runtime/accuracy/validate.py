"""``neuron-serve validate``: our logits against transformers' on the same weights.

Each prompt is extended by the reference's own greedy tokens, then both models score the whole
sequence (teacher forcing): ours prefills the prompt in chunks and decodes the continuation
token by token through the engine's runner, transformers runs it in one pass. Every position
is held to the dtype's ``Tolerance``; a failing run goes to the accuracy debugger (the first
module whose output diverges) and every decoder run checks the paged KV against transformers'
``past_key_values``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neuron_runtime.accuracy.debugger import Divergence, find_divergence
from neuron_runtime.accuracy.kv_check import KVCheck, compare_kv
from neuron_runtime.accuracy.metrics import (
    TOLERANCES,
    PositionErrors,
    Tolerance,
    compare_hidden,
    compare_logits,
)
from neuron_runtime.accuracy.teacher import OurEncoder, OurModel, Reference, Sample, tokenize_prompt
from neuron_runtime.loader import load_hf_config
from neuron_runtime.model_store import resolve_model

# Text of every kind the models meet: prose, code, numbers, another language, a chat turn.
DEFAULT_PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, and the sea",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 5, 8, 13,",
    "Les fleurs du jardin sont",
)
IMAGE_PROMPT = "<image>Describe this picture in one sentence:"


@dataclass(frozen=True)
class PromptSpec:
    """One validation prompt; ``images`` are file paths or PIL images (``<image>`` each)."""

    name: str
    prompt: str
    images: tuple[Any, ...] = ()


def synthetic_image(seed: int, size: int = 64) -> Any:
    """A deterministic RGB test picture: a colour gradient under seeded noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], ramp[::-1, None]), -1)
    pixels = np.clip(pixels + rng.normal(0, 40, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def default_prompts(multimodal: bool) -> list[PromptSpec]:
    specs = [PromptSpec(f"prompt-{i}", p) for i, p in enumerate(DEFAULT_PROMPTS)]
    if multimodal:
        specs += [PromptSpec(f"image-{i}", IMAGE_PROMPT, (synthetic_image(i),)) for i in range(2)]
    return specs


def load_prompts(path: str | Path) -> list[PromptSpec]:
    """A prompts file: ``.jsonl`` lines of ``{"prompt": str, "images": [paths]}`` (images
    relative to the file), or any other file with one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {path} does not exist")
    specs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        name = f"{path.name}:{number}"
        if path.suffix != ".jsonl":
            specs.append(PromptSpec(name, line))
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not JSON ({exc.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f'{name}: expected {{"prompt": str, "images": [paths]}}')
        images = entry.get("images", [])
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise ValueError(f"{name}: images must be a list of file paths")
        files = [path.parent / image for image in images]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{name}: image files not found: {missing}")
        specs.append(PromptSpec(name, entry["prompt"], tuple(f.read_bytes() for f in files)))
    if not specs:
        raise ValueError(f"prompts file {path} has no prompts")
    return specs


@dataclass
class SampleReport:
    """One sequence's errors, position by position."""

    name: str
    num_prompt_tokens: int
    num_tokens: int
    positions: list[PositionErrors]
    kv: KVCheck | None = None

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.positions) and (self.kv is None or self.kv.passed)

    @property
    def first_failure(self) -> int | None:
        return next((p.position for p in self.positions if not p.passed), None)

    def summary(self) -> dict[str, Any]:
        ps = self.positions
        kls = [p.kl for p in ps if p.kl is not None]
        topks = [p.topk for p in ps if p.topk is not None]
        top1 = [p.top1_match for p in ps if p.top1_match is not None]
        return {
            "name": self.name,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_tokens": self.num_tokens,
            "max_abs": max(p.max_abs for p in ps),
            "max_rel": max(p.max_rel for p in ps),
            "max_kl": max(kls) if kls else None,
            "min_topk": min(topks) if topks else None,
            "top1_agreement": sum(top1) / len(top1) if top1 else None,
            "first_failing_position": self.first_failure,
            "kv": None if self.kv is None else self.kv.to_dict(),
            "passed": self.passed,
        }


@dataclass
class ValidationReport:
    model: str
    architecture: str
    dtype: str
    tolerance: Tolerance
    top_k: int
    samples: list[SampleReport] = field(default_factory=list)
    divergence: Divergence | None = None
    engine_dtype: str = "float32"

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "engine_dtype": self.engine_dtype,
            "tolerance": vars(self.tolerance),
            "top_k": self.top_k,
            "passed": self.passed,
            "samples": [
                {**s.summary(), "positions": [p.to_dict() for p in s.positions]}
                for s in self.samples
            ],
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def table(self) -> str:
        """The per-sample summary, and the debugger's finding if there is one."""
        head = [
            "sample",
            "tokens",
            "max abs",
            "max rel",
            "max KL",
            f"top-{self.top_k}",
            "top-1",
            "KV",
            "",
        ]
        rows = [head]
        for s in self.samples:
            d = s.summary()
            kv = "-" if s.kv is None else f"{s.kv.max_abs:.1e}"
            rows.append(
                [
                    s.name,
                    f"{d['num_prompt_tokens']}+{d['num_tokens'] - d['num_prompt_tokens']}",
                    f"{d['max_abs']:.2e}",
                    f"{d['max_rel']:.2e}",
                    "-" if d["max_kl"] is None else f"{d['max_kl']:.1e}",
                    "-" if d["min_topk"] is None else f"{d['min_topk']:.2f}",
                    "-" if d["top1_agreement"] is None else f"{d['top1_agreement']:.0%}",
                    kv,
                    "ok" if s.passed else f"FAIL at {s.first_failure}",
                ]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        t = self.tolerance
        lines.append(
            f"{self.model} ({self.architecture}), engine {self.engine_dtype}, reference "
            f"{self.dtype}: "
            f"abs <= {t.atol:g} + {t.rtol:g}*max|logit|, KL <= {t.kl:g}, top-{self.top_k} >= "
            f"{t.topk:g}: {'PASSED' if self.passed else 'FAILED'}"
        )
        if self.divergence is not None:
            lines.append(self.divergence.describe())
        return "\n".join(lines)


class Validator:
    """Our model (the engine's runner) and transformers' reference, loaded once for any number
    of ``run`` calls. ``dtype`` is the reference's; ``engine_dtype`` the engine's (float32, or
    bfloat16 linear layers: then held to the bfloat16 tolerances, whatever the reference)."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        engine_dtype: str = "float32",
    ) -> None:
        if dtype not in TOLERANCES:
            raise ValueError(f"dtype must be one of {sorted(TOLERANCES)}, got {dtype!r}")
        self.model_name = model
        self.dtype = dtype
        self.engine_dtype = engine_dtype
        path = resolve_model(model)
        self.architecture = (load_hf_config(path).get("architectures") or ["?"])[0]
        self.reference = Reference(path, self.architecture, dtype)
        self.ours: OurModel | OurEncoder
        if self.reference.is_encoder:
            if engine_dtype != "float32":
                raise ValueError("an encoder runs in float32 only")
            self.ours = OurEncoder(model, device, num_threads)
        else:
            self.ours = _our_model(model, path, device, num_threads, engine_dtype)

    def samples(self, prompts: list[PromptSpec] | None, max_new_tokens: int) -> list[Sample]:
        """The prompts (default: ``default_prompts``) tokenized and continued by the
        reference's greedy tokens (none for an encoder)."""
        specs = prompts if prompts is not None else default_prompts(self.ours.vision is not None)
        ours = self.ours
        return [
            self.reference.continue_greedy(
                tokenize_prompt(ours.tokenizer, ours.vision, s.name, s.prompt, list(s.images)),
                max_new_tokens,
            )
            for s in specs
        ]

    def run(
        self,
        prompts: list[PromptSpec] | None = None,
        max_new_tokens: int = 8,
        top_k: int = 5,
        tolerance: Tolerance | None = None,
        debug: bool = True,
        snapshot_dir: str | Path | None = None,
    ) -> ValidationReport:
        """Compares every sample (module docstring); ``debug`` runs the accuracy debugger on
        the first failing one (writing both sides' module outputs as snapshots under
        ``snapshot_dir`` when given)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        tol = tolerance or TOLERANCES["bfloat16" if self.engine_dtype == "bfloat16" else self.dtype]
        samples = self.samples(prompts, max_new_tokens)
        report = ValidationReport(
            self.model_name,
            self.architecture,
            self.dtype,
            tol,
            top_k,
            engine_dtype=self.engine_dtype,
        )
        for sample in samples:
            report.samples.append(_compare(self.ours, self.reference, sample, tol, top_k))
        failed = [s for s, r in zip(samples, report.samples, strict=True) if not r.passed]
        if debug and failed:
            report.divergence = find_divergence(
                self.ours, self.reference, failed[0], tol, snapshot_dir
            )
        return report


def validate(
    model: str,
    dtype: str = "float32",
    prompts: list[PromptSpec] | None = None,
    max_new_tokens: int = 8,
    top_k: int = 5,
    device: str = "cpu",
    num_threads: int | None = None,
    tolerance: Tolerance | None = None,
    debug: bool = True,
    snapshot_dir: str | Path | None = None,
    engine_dtype: str = "float32",
) -> ValidationReport:
    """``Validator(model, dtype, device, num_threads, engine_dtype).run(...)``: one validation."""
    validator = Validator(model, dtype, device, num_threads, engine_dtype)
    return validator.run(prompts, max_new_tokens, top_k, tolerance, debug, snapshot_dir)


def _our_model(
    model: str, path: Path, device: str, num_threads: int | None, dtype: str
) -> OurModel:
    from neuron_runtime.config import text_config

    cfg = load_hf_config(path)
    limit = int(text_config(cfg).get("max_position_embeddings") or 2048)
    return OurModel(model, min(limit, 4096), device, num_threads, dtype=dtype)


def _compare(
    ours: OurModel | OurEncoder, reference: Reference, sample: Sample, tol: Tolerance, k: int
) -> SampleReport:
    n = len(sample.token_ids)
    if isinstance(ours, OurEncoder):
        errors = compare_hidden(ours.hidden_states(sample), reference.logits(sample), tol)
        return SampleReport(sample.name, sample.num_prompt_tokens, n, errors)
    got = ours.logits(sample)
    expected, past = reference.logits_and_cache(sample)
    kv = compare_kv(ours.export_kv(n), past, tol)
    return SampleReport(
        sample.name, sample.num_prompt_tokens, n, compare_logits(got, expected, tol, k), kv
    )
