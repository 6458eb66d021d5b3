"""Turns a scheduled step into tensors, runs the model, samples.

Everything that depends on the batch's shapes happens here, so a static-shape backend can pad
to buckets in one place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from neuron_runtime.backends import Backend
from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_transfer import KVPayload
from neuron_runtime.layers.attention import (
    AttentionMetadata,
    PrefillSlice,
    decode_block_tables,
    decode_groups,
)
from neuron_runtime.loader import load_model
from neuron_runtime.models.llava import LlavaForConditionalGeneration
from neuron_runtime.models.registry import model_class
from neuron_runtime.multimodal import ImageProcessorConfig, VisionEncoder
from neuron_runtime.sampler import (
    SamplingBatch,
    apply_allowed_tokens,
    apply_logit_bias,
    apply_penalties,
    sample,
    token_counts,
    top_logprobs,
)
from neuron_runtime.scheduler import ScheduledSeq, SchedulerOutput
from neuron_runtime.structured_output import apply_grammar_bitmasks


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # req_id -> new token
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> error message
    # req_id -> {token id: logprob}: the sampled token and the top ``logprobs`` tokens
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # req_id -> per predicted prompt token, {token id: logprob} (the actual token + top-N)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


def _decodes_first(seq: ScheduledSeq) -> tuple[bool, int]:
    is_decode = len(seq.token_ids) == 1
    return (not is_decode, seq.start_pos if is_decode else 0)


def kv_bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    return 2 * m.num_layers * m.num_kv_heads * config.cache.block_size * m.head_dim * 4


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the per-request random generators."""

    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.block_size = config.cache.block_size
        cls = model_class(config.model.architecture)
        model = load_model(cls, config.model.hf_config, config.model.path)
        self.model: Any = backend.prepare_model(model)
        # A vision-language model encodes images with its own tower (at request admission).
        self.vision: VisionEncoder | None = None
        if config.model.is_multimodal:
            processor = ImageProcessorConfig.from_folder(config.model.path)
            self.vision = VisionEncoder(
                cast(LlavaForConditionalGeneration, self.model), processor, self.device
            )
        self.num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_bytes // kv_bytes_per_block(config)
        )
        m = config.model
        shape = (m.num_kv_heads, self.num_blocks, self.block_size, m.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, device=self.device),
                torch.zeros(shape, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}

    def release(self, req_id: str) -> None:
        """Forgets a finished request's random state."""
        self.generators.pop(req_id, None)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [block_table[p // bs] * bs + p % bs for p in range(num_tokens)], device=self.device
        )

    @torch.inference_mode()
    def export_kv(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """Copies the KV of a sequence's first ``num_tokens`` tokens out of the cache.

        Returns [2, num_layers, num_kv_heads, num_tokens, head_dim] float32 (kv_transfer.py).
        """
        slots = self._slots(block_table, num_tokens)
        layers = []
        for k_cache, v_cache in self.kv_caches:
            kvh, num_blocks, bs, d = k_cache.shape
            flat = num_blocks * bs
            k = k_cache.view(kvh, flat, d).index_select(1, slots)  # [kvh, T, d]
            v = v_cache.view(kvh, flat, d).index_select(1, slots)
            layers.append(torch.stack((k, v)))  # [2, kvh, T, d]
        return torch.stack(layers, dim=1).cpu().numpy()

    @torch.inference_mode()
    def import_kv(self, block_table: list[int], payload: KVPayload) -> None:
        """Writes a payload's tokens into the sequence's blocks (positions 0..num_tokens-1)."""
        slots = self._slots(block_table, payload.metadata.num_tokens)
        with warnings.catch_warnings():
            # A read-only view of shared memory (Ray's object store): torch only reads it.
            warnings.simplefilter("ignore", UserWarning)
            kv = torch.from_numpy(payload.kv).to(self.device)  # [2, L, kvh, T, d]
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            kvh, num_blocks, bs, d = k_cache.shape
            k_cache.view(kvh, num_blocks * bs, d).index_copy_(1, slots, kv[0, layer])
            v_cache.view(kvh, num_blocks * bs, d).index_copy_(1, slots, kv[1, layer])

    def generator_state(self, req_id: str) -> np.ndarray | None:
        """The request's seeded generator state (None when it samples unseeded or greedily)."""
        gen = self.generators.get(req_id)
        return None if gen is None else gen.get_state().numpy().copy()

    def restore_generator(self, req_id: str, seed: int, state: np.ndarray) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        gen.set_state(torch.from_numpy(np.array(state, dtype=np.uint8)))
        self.generators[req_id] = gen

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Single-token slices (decodes) first, shortest context first: they are batched into
        # a few attention calls by context length (layers/attention.py).
        seqs = sorted(out.seqs, key=_decodes_first)
        for seq in seqs:
            if seq.kv_import is not None:
                self.import_kv(seq.block_table, seq.kv_import)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        prefills: list[PrefillSlice] = []
        prompt_rows: list[tuple[ScheduledSeq, int]] = []  # (slice, its first row)
        image_rows: list[tuple[ScheduledSeq, int]] = []  # (slice with images, its first row)
        num_decode = 0
        bs = self.block_size
        for seq in seqs:
            q_start = len(input_ids)
            n = len(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + n)
            if seq.prompt_logprob_targets:
                prompt_rows.append((seq, q_start + seq.prompt_logprob_offset))
            if seq.mm_inputs:
                image_rows.append((seq, q_start))
            input_ids.extend(seq.token_ids)
            positions.extend(pos)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            if n == 1 and not prefills:
                num_decode += 1
            else:
                num_blocks = -(-(seq.start_pos + n) // bs)
                block_ids = torch.tensor(seq.block_table[:num_blocks], device=self.device)
                prefills.append(PrefillSlice(q_start, n, seq.start_pos, block_ids))
            if seq.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        meta = self._metadata(seqs[:num_decode], slots, num_decode, prefills)
        ids_t = torch.tensor(input_ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        if image_rows:
            embeds = self._embeds_with_images(ids_t, image_rows)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta, inputs_embeds=embeds)
        else:
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        result = ModelRunnerOutput()
        for seq, row in prompt_rows:
            result.prompt_logprobs[seq.req_id] = self._prompt_logprobs(seq, hidden, row)
        if not sample_seqs:
            return result
        last_hidden = hidden[sample_rows]  # [S, H]
        logits = self.model.compute_logits(last_hidden)  # [S, V]
        raw_logits = logits
        logits = self._process_logits(sample_seqs, logits)
        banned = [
            (row, s.banned_token_ids) for row, s in enumerate(sample_seqs) if s.banned_token_ids
        ]
        if banned:
            logits = logits.clone() if logits is raw_logits else logits
            for row, ids in banned:
                logits[row, ids] = float("-inf")
        kernels = self.backend.kernels
        argmax = kernels.argmax if kernels is not None and logits.is_contiguous() else None
        token_tensor = sample(logits, self._sampling_batch(sample_seqs), argmax)
        tokens = token_tensor.tolist()
        num_top = max((s.params.logprobs or 0) for s in sample_seqs)
        if any(s.params.logprobs is not None for s in sample_seqs):
            result.logprobs = self._logprobs(sample_seqs, raw_logits, token_tensor, num_top)
        # NaN anywhere in a row's hidden state poisons all its logits; checking H values per
        # row instead of V is 85x less work.
        bad = torch.isnan(last_hidden).any(dim=-1).tolist()
        for seq, token, is_bad in zip(sample_seqs, tokens, bad, strict=True):
            if is_bad:
                result.failed[seq.req_id] = "the model produced NaN logits"
            else:
                result.sampled[seq.req_id] = token
        return result

    def _embeds_with_images(
        self, ids: torch.Tensor, image_rows: list[tuple[ScheduledSeq, int]]
    ) -> torch.Tensor:
        """Token embeddings [T, hidden] with image placeholder rows replaced by features.

        A slice covers positions [start_pos, start_pos + n): it takes the part of each image
        inside it (a chunked prefill or a prefix-cache hit may split an image).
        """
        embeds = self.model.embed_input_ids(ids)
        for seq, q_start in image_rows:
            end = seq.start_pos + len(seq.token_ids)
            for m in seq.mm_inputs:
                assert m.features is not None, "the engine encodes images at admission"
                lo, hi = max(m.offset, seq.start_pos), min(m.offset + m.length, end)
                rows = m.features.embeds[lo - m.offset : hi - m.offset]  # [hi - lo, hidden]
                first = q_start + lo - seq.start_pos
                embeds[first : first + hi - lo] = torch.tensor(rows, device=self.device)
        return embeds

    def _process_logits(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """Penalties and logit_bias; returns ``logits`` itself when no row asks for them."""
        if any(s.params.has_penalties for s in seqs):
            vocab, dev = logits.shape[-1], self.device
            logits = apply_penalties(
                logits,
                token_counts([s.prompt_token_ids for s in seqs], vocab, dev),
                token_counts([s.output_token_ids for s in seqs], vocab, dev),
                torch.tensor([s.params.presence_penalty for s in seqs], device=dev),
                torch.tensor([s.params.frequency_penalty for s in seqs], device=dev),
                torch.tensor([s.params.repetition_penalty for s in seqs], device=dev),
            )
        if any(s.params.logit_bias for s in seqs):
            logits = apply_logit_bias(logits, [s.params.logit_bias for s in seqs])
        if any(s.params.allowed_token_ids for s in seqs):
            logits = apply_allowed_tokens(logits, [s.params.allowed_token_ids for s in seqs])
        if any(s.grammar_bitmask is not None for s in seqs):
            logits = apply_grammar_bitmasks(logits, [s.grammar_bitmask for s in seqs])
        return logits

    def _prompt_logprobs(
        self, seq: ScheduledSeq, hidden: torch.Tensor, first_row: int
    ) -> list[dict[int, float]]:
        targets = seq.prompt_logprob_targets
        logits = self.model.compute_logits(hidden[first_row : first_row + len(targets)])  # [P, V]
        target_t = torch.tensor(targets, device=self.device)
        chosen, top_ids, top_values = top_logprobs(
            logits, target_t, max(seq.params.prompt_logprobs or 0, 1)
        )
        n = seq.params.prompt_logprobs or 0
        entries = []
        for i, token in enumerate(targets):
            entry = dict(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True))
            entry[token] = float(chosen[i])
            entries.append(entry)
        return entries

    def _logprobs(
        self,
        seqs: list[ScheduledSeq],
        logits: torch.Tensor,
        tokens: torch.Tensor,
        num_top: int,
    ) -> dict[str, dict[int, float]]:
        sampled, top_ids, top_values = top_logprobs(logits, tokens, max(num_top, 1))
        out = {}
        for row, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None:
                continue
            entry = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True))
            entry[int(tokens[row])] = float(sampled[row])
            out[seq.req_id] = entry
        return out

    def _metadata(
        self,
        decodes: list[ScheduledSeq],
        slots: list[int],
        num_decode: int,
        prefills: list[PrefillSlice],
    ) -> AttentionMetadata:
        slot_mapping = torch.tensor(slots, device=self.device)
        tables = [s.block_table for s in decodes]
        lens = [s.start_pos + 1 for s in decodes]
        kernels = self.backend.kernels
        if kernels is None:
            groups = decode_groups(tables, lens, self.block_size, self.device)
            return AttentionMetadata(slot_mapping, num_decode, prefills, decode_groups=groups)
        decode_tables, decode_lens = decode_block_tables(tables, lens, self.block_size)
        return AttentionMetadata(
            slot_mapping,
            num_decode,
            prefills,
            kernels=kernels,
            decode_tables=decode_tables,
            decode_lens=decode_lens,
        )

    def _sampling_batch(self, seqs: list[ScheduledSeq]) -> SamplingBatch:
        generators: list[torch.Generator | None] = []
        for seq in seqs:
            seed = seq.params.seed
            if seed is None or seq.params.greedy:
                generators.append(None)
                continue
            gen = self.generators.get(seq.req_id)
            if gen is None:
                gen = torch.Generator(device=self.device).manual_seed(seed)
                self.generators[seq.req_id] = gen
            generators.append(gen)
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor([s.params.temperature for s in seqs], device=dev),
            top_k=torch.tensor([s.params.top_k for s in seqs], device=dev),
            top_p=torch.tensor([s.params.top_p for s in seqs], device=dev),
            min_p=torch.tensor([s.params.min_p for s in seqs], device=dev),
            generators=generators,
        )
