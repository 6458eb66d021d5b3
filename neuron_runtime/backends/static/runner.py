"""The static runner: a step's slices padded into buckets and run as precompiled graphs.

Per step, the decodes run as one ``[num_seqs, 1]`` graph (with speculative decoding, when a
verify slice is among them, as one ``[num_seqs, k + 1]`` grid) and each prefill slice as one
``[1, num_tokens]`` graph (buckets.py); the logits of each slice's last token come out of the
same graph. Sampling runs as a second graph over the sampled rows (sampler.py). Everything
that cannot be static (logprobs, prompt logprobs, NaN checks) runs on the host afterwards,
from the returned hidden states and logits.

Every bucket's graphs are compiled at start (``warm_up``); a compile after that is a shape
the buckets missed, reported by the recompile guard (``on_recompile``: warn or error).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from tqdm import tqdm

from neuron_runtime.backends.base import Backend
from neuron_runtime.backends.static.buckets import Bucket, Buckets
from neuron_runtime.backends.static.compilers import Compiler, make_compiler, set_cache_dir
from neuron_runtime.backends.static.ops import StaticAttentionMetadata
from neuron_runtime.backends.static.sampler import (
    SamplerKind,
    StaticSamplingInputs,
    greedy_tokens,
    penalized_tokens,
    random_tokens,
    sampler_args,
    select_rows,
)
from neuron_runtime.config import EngineConfig
from neuron_runtime.model_store import cache_dir

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class RecompileError(RuntimeError):
    """A graph was compiled after warm-up with ``on_recompile: error``."""


def graph_cache_dir(config: EngineConfig, buckets: Buckets) -> str:
    """A compile-cache folder per model, dtype, parallel degree, buckets and compiler."""
    key = {
        "model": config.model.path,
        "architecture": config.model.architecture,
        "dtype": "float32",
        "tensor_parallel": 1,
        "buckets": asdict(buckets),
        "graph_mode": config.graph.graph_mode,
        "max_top_k": config.graph.max_top_k,
        "torch": torch.__version__,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return str(cache_dir() / "graphs" / f"{config.graph.graph_mode}-{digest}")


class StaticRunner:
    """Runs a model's steps as graphs compiled per bucket; owns the compiled callables."""

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        kv_caches: list[KVCache],
        null_block: int,
        backend: Backend,
    ) -> None:
        self.config = config
        self.model = model
        self.kv_caches = kv_caches
        self.device = backend.device
        self.block_size = config.cache.block_size
        self.null_block = null_block  # a reserved block padding writes into
        self.buckets = Buckets.from_config(config)
        self.vocab_size = config.model.vocab_size
        self.hidden_size = int(config.model.text_config["hidden_size"])
        self.max_top_k = config.graph.max_top_k
        self.on_recompile = config.graph.on_recompile
        self.cache_path = graph_cache_dir(config, self.buckets)
        set_cache_dir(config.graph.graph_mode, self.cache_path)
        # Lazy devices: the caches' zero fill must not become part of the first graph.
        backend.synchronize()
        warm_up_list = self.buckets.all()
        self.compiler: Compiler = make_compiler(config.graph.graph_mode, len(warm_up_list))
        if config.graph.scope == "layer":
            for layer in model.decoder_layers:
                self.compiler.compile_module(layer)
            self._model_graph: Callable[..., Any] = self._model_step
        else:
            self._model_graph = self.compiler.compile(self._model_step)
        self._samplers: dict[SamplerKind, Callable[..., torch.Tensor]] = {
            SamplerKind.GREEDY: self.compiler.compile(greedy_tokens),
            SamplerKind.RANDOM: self.compiler.compile(
                functools.partial(random_tokens, max_top_k=self.max_top_k)
            ),
            SamplerKind.PENALIZED: self.compiler.compile(
                functools.partial(penalized_tokens, max_top_k=self.max_top_k)
            ),
        }
        # Prefill slices sample one row each: size 1 is always among the sampler shapes.
        self.sampler_sizes = sorted({1, *self.buckets.seqs})
        self.compile_seconds: dict[str, float] = {}  # graph name -> warm-up seconds
        self.num_compiles_after_warm_up = 0
        self._warm_compiles: int | None = None
        self.phase_runs: Counter[str] = Counter()  # model graph runs per phase, warm-up included

    # Graph bodies ---------------------------------------------------------------------------
    def _model_step(
        self,
        kv_caches: list[KVCache],
        input_ids: torch.Tensor,  # [S * Q]
        image_embeds: torch.Tensor,  # [S * Q, hidden]: image features where image_mask
        image_mask: torch.Tensor,  # [S * Q] bool
        positions: torch.Tensor,  # [S * Q]
        slot_mapping: torch.Tensor,  # [S * Q]
        block_tables: torch.Tensor,  # [S, B]
        last_rows: torch.Tensor,  # [S]: each row's last real token
        num_seqs: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden states [S * Q, hidden], each row's last-token logits [S, V] and whether
        that token's hidden state holds a NaN [S]."""
        meta = StaticAttentionMetadata(
            slot_mapping, positions.view(num_seqs, num_tokens), block_tables, num_seqs, num_tokens
        )
        embeds = self.model.embed_input_ids(input_ids)
        embeds = torch.where(image_mask.unsqueeze(-1), image_embeds, embeds)
        hidden = self.model(input_ids, positions, kv_caches, meta, inputs_embeds=embeds)
        last = hidden[last_rows]
        return hidden, self.model.compute_logits(last), torch.isnan(last).any(dim=-1)

    # Warm-up and the recompile guard -----------------------------------------------------
    def warm_up(self) -> None:
        """Compiles every bucket's graphs (a progress bar on stderr), then arms the guard."""
        from neuron_runtime.model_runner import no_grad

        with no_grad(static=True):  # as the steps run: grad mode is part of the guards
            self._warm_up()

    def _warm_up(self) -> None:
        start = time.perf_counter()
        model_buckets = self.buckets.all()
        sampler_shapes = [(n, kind) for n in self.sampler_sizes for kind in SamplerKind]
        bar = tqdm(
            total=len(model_buckets) + len(sampler_shapes),
            desc=f"compiling graphs ({self.config.graph.graph_mode})",
            file=sys.stderr,
            disable=None,
        )
        for bucket in model_buckets:
            t = time.perf_counter()
            self._run_model(bucket, self._rows(bucket, [], [], [], None))
            self.compile_seconds[str(bucket)] = time.perf_counter() - t
            bar.update()
        for num_seqs, kind in sampler_shapes:
            t = time.perf_counter()
            logits = torch.zeros(num_seqs, self.vocab_size).to(self.device)
            self._run_sampler(
                logits, select_rows(self._template(kind), [None] * num_seqs, self.device)
            )
            name = f"sampler {kind.name.lower()} {num_seqs}"
            self.compile_seconds[name] = time.perf_counter() - t
            bar.update()
        bar.close()
        self._warm_compiles = self.compiler.num_compiles
        logger.info(
            "compiled %d graphs in %.1f s (cache %s)",
            self._warm_compiles,
            time.perf_counter() - start,
            self.cache_path,
        )

    def _check_compiles(self, what: str) -> None:
        if self._warm_compiles is None:
            return
        extra = self.compiler.num_compiles - self._warm_compiles
        if extra > self.num_compiles_after_warm_up:
            self.num_compiles_after_warm_up = extra
            message = f"a graph was compiled after warm-up ({what}): the buckets miss a shape"
            if self.on_recompile == "error":
                raise RecompileError(message)
            logger.warning(message)

    # Model graphs ---------------------------------------------------------------------------
    def _rows(
        self,
        bucket: Bucket,
        ids: list[list[int]],
        positions: list[list[int]],
        tables: list[list[int]],
        images: tuple[list[tuple[int, int]], torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """Real rows (each its tokens, positions and block table) padded to ``bucket``, built
        on the host and moved to the device in one go (no device op outside the graphs).

        ``images``: ((row, token index) of each image feature, features [n, hidden]).
        """
        q, bs, null = bucket.num_tokens, self.block_size, self.null_block
        flat_ids, flat_pos, slots, padded_tables, last = [], [], [], [], []
        for s in range(bucket.num_seqs):
            real = s < len(ids)
            row_ids, row_pos = (ids[s], positions[s]) if real else ([], [])
            table = tables[s] if real else []
            pad = q - len(row_ids)
            flat_ids += row_ids + [0] * pad
            flat_pos += row_pos + [0] * pad
            slots += [table[p // bs] * bs + p % bs for p in row_pos] + [null * bs] * pad
            padded_tables.append(table + [null] * (bucket.context_blocks - len(table)))
            last.append(s * q + max(len(row_ids), 1) - 1)
        image_embeds = torch.zeros(bucket.num_seqs * q, self.hidden_size)
        image_mask = torch.zeros(bucket.num_seqs * q, dtype=torch.bool)
        if images is not None:
            index = torch.tensor([s * q + i for s, i in images[0]], dtype=torch.long)
            image_embeds[index] = images[1]
            image_mask[index] = True
        host = {
            "input_ids": torch.tensor(flat_ids),
            "image_embeds": image_embeds,
            "image_mask": image_mask,
            "positions": torch.tensor(flat_pos),
            "slot_mapping": torch.tensor(slots),
            "block_tables": torch.tensor(padded_tables),
            "last_rows": torch.tensor(last),
        }
        return {name: t.to(self.device) for name, t in host.items()}

    def _run_model(
        self, bucket: Bucket, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self._model_graph(
            self.kv_caches, **inputs, num_seqs=bucket.num_seqs, num_tokens=bucket.num_tokens
        )
        self.phase_runs[bucket.phase] += 1
        self._check_compiles(str(bucket))
        return out

    def execute(
        self,
        slices: list[tuple[list[int], int, list[int]]],  # (tokens, start_pos, block table)
        images: tuple[list[int], torch.Tensor] | None,  # (step rows, features [n, hidden])
        sampling: StaticSamplingInputs | None,  # one row per sampled slice
        sampled: list[int],  # the slices that sample, in order
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Runs a step's graphs: the short slices (one token; with speculative decoding up to
        k + 1) as one ``[num_seqs, 1]`` or ``[num_seqs, k + 1]`` grid, each other slice as a
        ``[1, num_tokens]`` prefill bucket, each followed by its sampler graph.

        ``slices`` are in the step's row order. Returns hidden states [T, hidden] in that
        order (only ``want_hidden``: prompt logprobs and verify slices read them), the sampled
        slices' raw logits [S, V], their tokens [S] and NaN flags [S] (on the CPU).
        """
        bs = self.block_size
        sample_row = {slice_idx: row for row, slice_idx in enumerate(sampled)}
        image_at = {}
        if images is not None:
            image_at = {step_row: i for i, step_row in enumerate(images[0])}
        first_row = [0]
        for tokens, _, _ in slices:
            first_row.append(first_row[-1] + len(tokens))
        short = [i for i, (t, _, _) in enumerate(slices) if len(t) <= self.buckets.verify_tokens]
        calls: list[tuple[Bucket, list[int]]] = []  # (bucket, its slices)
        if short:
            context = max(-(-(slices[i][1] + len(slices[i][0])) // bs) for i in short)
            widest = max(len(slices[i][0]) for i in short)
            calls.append((self.buckets.rows(len(short), widest, context), short))
        for i, (tokens, start, _) in enumerate(slices):
            if len(tokens) > self.buckets.verify_tokens:
                blocks = -(-(start + len(tokens)) // bs)
                calls.append((self.buckets.prefill(len(tokens), blocks), [i]))
        hidden_parts: dict[int, torch.Tensor] = {}
        logits_rows, token_rows, nan_rows = {}, {}, {}
        for bucket, members in calls:
            ids, positions, tables = [], [], []
            for i in members:
                tokens, start, table = slices[i]
                ids.append(tokens)
                positions.append(list(range(start, start + len(tokens))))
                tables.append(table[: -(-(start + len(tokens)) // bs)])
            bucket_images = None
            if image_at:
                where, rows = [], []
                for s, i in enumerate(members):
                    for j in range(len(ids[s])):
                        if first_row[i] + j in image_at:
                            where.append((s, j))
                            rows.append(image_at[first_row[i] + j])
                if rows:
                    assert images is not None
                    bucket_images = (where, images[1][rows])
            inputs = self._rows(bucket, ids, positions, tables, bucket_images)
            hidden, logits, nan = self._run_model(bucket, inputs)
            if want_hidden:
                q = bucket.num_tokens
                for s, i in enumerate(members):
                    hidden_parts[i] = hidden[s * q : s * q + len(ids[s])]
            picked = [sample_row.get(i) for i in members]
            if sampling is None or all(p is None for p in picked):
                continue
            rows_in_bucket = picked + [None] * (bucket.num_seqs - len(picked))
            chosen = self._run_sampler(logits, select_rows(sampling, rows_in_bucket, self.device))
            chosen, nan, logits = chosen.cpu(), nan.cpu(), logits.cpu()
            for s, row in enumerate(picked):
                if row is not None:
                    token_rows[row], nan_rows[row], logits_rows[row] = chosen[s], nan[s], logits[s]
        n = len(sampled)
        vocab = self.vocab_size
        hidden_all = None
        if want_hidden and hidden_parts:
            hidden_all = torch.cat([hidden_parts[i] for i in range(len(slices))])
        if not n:
            return hidden_all, torch.empty(0, vocab), None, torch.empty(0, dtype=torch.bool)
        return (
            hidden_all,
            torch.stack([logits_rows[r] for r in range(n)]),
            torch.stack([token_rows[r] for r in range(n)]),
            torch.stack([nan_rows[r] for r in range(n)]),
        )

    # Sampler graphs -------------------------------------------------------------------------
    def _template(self, kind: SamplerKind) -> StaticSamplingInputs:
        """Inputs of ``kind`` with no rows: ``select_rows`` pads them to any size."""

        def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(0, *shape, dtype=dtype)

        vocab = self.vocab_size
        inputs = StaticSamplingInputs(kind=kind, bias=empty(vocab))
        if kind != SamplerKind.GREEDY:
            inputs.temperature, inputs.top_k = empty(), empty(dtype=torch.long)
            inputs.top_p, inputs.min_p, inputs.noise = empty(), empty(), empty(vocab)
        if kind == SamplerKind.PENALIZED:
            inputs.prompt_counts, inputs.output_counts = empty(vocab), empty(vocab)
            inputs.presence, inputs.frequency, inputs.repetition = empty(), empty(), empty()
        return inputs

    def _run_sampler(self, logits: torch.Tensor, inputs: StaticSamplingInputs) -> torch.Tensor:
        tokens = self._samplers[inputs.kind](logits, *sampler_args(inputs))
        self._check_compiles(f"sampler {inputs.kind.name.lower()} {logits.shape[0]}")
        return tokens
