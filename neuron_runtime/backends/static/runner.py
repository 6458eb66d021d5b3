"""The static runner: a step's slices padded into buckets and run as precompiled graphs.

Per step, the decodes run as one ``[num_seqs, 1]`` graph and each prefill slice as one
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
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from tqdm import tqdm

from neuron_runtime.backends.static.buckets import Bucket, Buckets, fit
from neuron_runtime.backends.static.compilers import Compiler, make_compiler, set_cache_dir
from neuron_runtime.backends.static.ops import StaticAttentionMetadata
from neuron_runtime.backends.static.sampler import (
    SamplerKind,
    StaticSamplingInputs,
    greedy_tokens,
    penalized_tokens,
    random_tokens,
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
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = config.cache.block_size
        self.null_block = null_block  # a reserved block padding writes into
        self.buckets = Buckets.from_config(config)
        self.vocab_size = config.model.vocab_size
        self.max_top_k = config.graph.max_top_k
        self.on_recompile = config.graph.on_recompile
        self.cache_path = graph_cache_dir(config, self.buckets)
        set_cache_dir(config.graph.graph_mode, self.cache_path)
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
        self.compile_seconds: dict[str, float] = {}  # graph name -> warm-up seconds
        self.num_compiles_after_warm_up = 0
        self._warm_compiles: int | None = None

    # Graph bodies ---------------------------------------------------------------------------
    def _model_step(
        self,
        kv_caches: list[KVCache],
        input_ids: torch.Tensor,  # [S * Q]
        embeds: torch.Tensor,  # [S * Q, hidden]
        positions: torch.Tensor,  # [S * Q]
        slot_mapping: torch.Tensor,  # [S * Q]
        block_tables: torch.Tensor,  # [S, B]
        last_rows: torch.Tensor,  # [S]: each row's last real token
        num_seqs: int,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = StaticAttentionMetadata(
            slot_mapping, positions.view(num_seqs, num_tokens), block_tables, num_seqs, num_tokens
        )
        hidden = self.model(input_ids, positions, kv_caches, meta, inputs_embeds=embeds)
        return hidden, self.model.compute_logits(hidden[last_rows])

    # Warm-up and the recompile guard -----------------------------------------------------
    @torch.inference_mode()  # as the steps run: grad mode is part of every graph's guards
    def warm_up(self) -> None:
        """Compiles every bucket's graphs (a progress bar on stderr), then arms the guard."""
        start = time.perf_counter()
        model_buckets = self.buckets.all()
        sampler_shapes = [(s, kind) for s in self.buckets.seqs for kind in SamplerKind]
        bar = tqdm(
            total=len(model_buckets) + len(sampler_shapes),
            desc=f"compiling graphs ({self.config.graph.graph_mode})",
            file=sys.stderr,
            disable=None,
        )
        for bucket in model_buckets:
            t = time.perf_counter()
            self._run_model(bucket, self._padding(bucket))
            self.compile_seconds[str(bucket)] = time.perf_counter() - t
            bar.update()
        for num_seqs, kind in sampler_shapes:
            t = time.perf_counter()
            logits = torch.zeros(num_seqs, self.vocab_size, device=self.device)
            self._run_sampler(logits, self._dummy_sampling(num_seqs, kind))
            self.compile_seconds[f"sampler {kind.name.lower()} {num_seqs}"] = (
                time.perf_counter() - t
            )
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
    def _padding(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        """Inputs of a bucket whose every row is padding."""
        rows = bucket.num_seqs * bucket.num_tokens
        null_slot = self.null_block * self.block_size
        hidden = self.model.embed_input_ids(torch.zeros(1, dtype=torch.long, device=self.device))
        return {
            "input_ids": torch.zeros(rows, dtype=torch.long, device=self.device),
            "embeds": hidden.new_zeros(rows, hidden.shape[-1]),
            "positions": torch.zeros(rows, dtype=torch.long, device=self.device),
            "slot_mapping": torch.full((rows,), null_slot, device=self.device),
            "block_tables": torch.full(
                (bucket.num_seqs, bucket.context_blocks), self.null_block, device=self.device
            ),
            "last_rows": torch.arange(bucket.num_seqs, device=self.device) * bucket.num_tokens,
        }

    def _run_model(
        self, bucket: Bucket, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._model_graph(
            self.kv_caches, **inputs, num_seqs=bucket.num_seqs, num_tokens=bucket.num_tokens
        )
        self._check_compiles(str(bucket))
        return out

    def _rows(
        self,
        bucket: Bucket,
        ids: list[list[int]],
        positions: list[list[int]],
        tables: list[list[int]],
        embeds: torch.Tensor,  # [real tokens, hidden], row after row
    ) -> dict[str, torch.Tensor]:
        """Real rows (each its tokens, positions and block table) padded to ``bucket``."""
        q, bs, null = bucket.num_tokens, self.block_size, self.null_block
        flat_ids, flat_pos, slots, padded_tables, last, index = [], [], [], [], [], []
        for s in range(bucket.num_seqs):
            row_ids = ids[s] if s < len(ids) else []
            row_pos = positions[s] if s < len(ids) else []
            table = tables[s] if s < len(ids) else []
            pad = q - len(row_ids)
            flat_ids += row_ids + [0] * pad
            flat_pos += row_pos + [0] * pad
            slots += [table[p // bs] * bs + p % bs for p in row_pos] + [null * bs] * pad
            padded_tables.append(table + [null] * (bucket.context_blocks - len(table)))
            last.append(s * q + max(len(row_ids), 1) - 1)
            index += [s * q + i for i in range(len(row_ids))]
        dev = self.device
        full = embeds.new_zeros(bucket.num_seqs * q, embeds.shape[-1])
        full[torch.tensor(index, dtype=torch.long, device=dev)] = embeds
        return {
            "input_ids": torch.tensor(flat_ids, device=dev),
            "embeds": full,
            "positions": torch.tensor(flat_pos, device=dev),
            "slot_mapping": torch.tensor(slots, device=dev),
            "block_tables": torch.tensor(padded_tables, device=dev),
            "last_rows": torch.tensor(last, device=dev),
        }

    def forward(
        self,
        decodes: list[tuple[int, int, list[int]]],  # (token, position, block table) per row
        prefills: list[tuple[list[int], int, list[int]]],  # (tokens, start_pos, block table)
        embeds: torch.Tensor,  # [T, hidden]: the decodes' rows, then each prefill's
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, hidden] in the same row order, and the logits of each slice's
        last token [num decodes + num prefills, vocab]."""
        hidden_parts, logits_parts = [], []
        bs = self.block_size
        if decodes:
            n = len(decodes)
            context = max(-(-(pos + 1) // bs) for _, pos, _ in decodes)
            bucket = self.buckets.decode(n, context)
            inputs = self._rows(
                bucket,
                [[token] for token, _, _ in decodes],
                [[pos] for _, pos, _ in decodes],
                [table[: -(-(pos + 1) // bs)] for _, pos, table in decodes],
                embeds[:n],
            )
            hidden, logits = self._run_model(bucket, inputs)
            hidden_parts.append(hidden[:n])
            logits_parts.append(logits[:n])
        row = len(decodes)
        for tokens, start, table in prefills:
            n = len(tokens)
            blocks = -(-(start + n) // bs)
            bucket = self.buckets.prefill(n, blocks)
            inputs = self._rows(
                bucket,
                [tokens],
                [list(range(start, start + n))],
                [table[:blocks]],
                embeds[row : row + n],
            )
            hidden, logits = self._run_model(bucket, inputs)
            hidden_parts.append(hidden[:n])
            logits_parts.append(logits)
            row += n
        return torch.cat(hidden_parts), torch.cat(logits_parts)

    # Sampler graphs -------------------------------------------------------------------------
    def _dummy_sampling(self, num_seqs: int, kind: SamplerKind) -> StaticSamplingInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        vocab = self.vocab_size
        inputs = StaticSamplingInputs(kind=kind, bias=zeros(num_seqs, vocab))
        if kind != SamplerKind.GREEDY:
            inputs.temperature = zeros(num_seqs)
            inputs.top_k = zeros(num_seqs, dtype=torch.long)
            inputs.top_p = zeros(num_seqs) + 1
            inputs.min_p = zeros(num_seqs)
            inputs.noise = zeros(num_seqs, vocab) + 1
        if kind == SamplerKind.PENALIZED:
            inputs.prompt_counts = zeros(num_seqs, vocab)
            inputs.output_counts = zeros(num_seqs, vocab)
            inputs.presence = zeros(num_seqs)
            inputs.frequency = zeros(num_seqs)
            inputs.repetition = zeros(num_seqs) + 1
        return inputs

    def _run_sampler(self, logits: torch.Tensor, inputs: StaticSamplingInputs) -> torch.Tensor:
        graph = self._samplers[inputs.kind]
        if inputs.kind == SamplerKind.GREEDY:
            tokens = graph(logits, inputs.bias)
        else:
            args = [
                logits,
                inputs.bias,
                inputs.temperature,
                inputs.top_k,
                inputs.top_p,
                inputs.min_p,
                inputs.noise,
            ]
            if inputs.kind == SamplerKind.PENALIZED:
                args += [
                    inputs.prompt_counts,
                    inputs.output_counts,
                    inputs.presence,
                    inputs.frequency,
                    inputs.repetition,
                ]
            tokens = graph(*args)
        self._check_compiles(f"sampler {inputs.kind.name.lower()} {logits.shape[0]}")
        return tokens

    def sample(self, logits: torch.Tensor, inputs: StaticSamplingInputs) -> torch.Tensor:
        """Tokens [n] for ``logits`` [n, V]; ``inputs`` hold n rows and are padded here."""
        n = logits.shape[0]
        size = fit(self.buckets.seqs, n)
        padded = StaticSamplingInputs(kind=inputs.kind, bias=_pad(inputs.bias, size))
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "noise",
            "prompt_counts",
            "output_counts",
            "presence",
            "frequency",
            "repetition",
        ):
            value = getattr(inputs, name)
            if value is not None:
                fill = 1 if name in ("top_p", "noise", "repetition") else 0
                setattr(padded, name, _pad(value, size, fill))
        return self._run_sampler(_pad(logits, size), padded)[:n]


def _pad(x: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    out = x.new_full((rows, *x.shape[1:]), fill)
    out[: x.shape[0]] = x
    return out
