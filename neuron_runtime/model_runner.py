"""Turns a scheduled step into tensors, runs the model, samples.

Everything that depends on the batch's shapes happens here, so a static-shape backend can pad
to buckets in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from neuron_runtime.backends import Backend
from neuron_runtime.backends.static.runner import StaticRunner
from neuron_runtime.backends.static.sampler import sampling_inputs
from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_budget import num_kv_blocks
from neuron_runtime.kv_transfer import KVBlockSource, KVPayload
from neuron_runtime.layers.attention import DecodeRows, PrefillSlice
from neuron_runtime.loader import load_model
from neuron_runtime.models.llava import LlavaForConditionalGeneration
from neuron_runtime.models.registry import model_class
from neuron_runtime.multimodal import ImageProcessorConfig, VisionEncoder
from neuron_runtime.parallel.layers import local_kv_heads
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
from neuron_runtime.structured_output.bitmask import apply_grammar_bitmasks, fix_greedy_tokens

if TYPE_CHECKING:
    from neuron_runtime.spec_decode.decoder import SpecDecoder


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # req_id -> new token
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> error message
    # req_id -> {token id: logprob}: the sampled token and the top ``logprobs`` tokens
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # req_id -> per predicted prompt token, {token id: logprob} (the actual token + top-N)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # req_id -> draft tokens the target accepted, before its ``sampled`` token (spec_decode/)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the raw logits [vocab] float32 its first token was sampled from, for the
    # requests in ``ModelRunner.prompt_logit_taps`` (online validation, accuracy/online.py)
    prompt_logits: dict[str, np.ndarray] = field(default_factory=dict)

    def merge(self, other: ModelRunnerOutput) -> None:
        """Adds another step's results over other requests."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).update(getattr(other, f.name))


CPU = torch.device("cpu")


def no_grad(static: bool) -> contextlib.AbstractContextManager[None]:
    """Inference mode for eager steps; plain no-grad for compiled graphs: under inference mode
    inductor rewrites the whole KV cache to write one slot (its in-place reinplacing pass does
    not apply; ~70x slower here), and XLA tensors refuse inference mode."""
    return torch.no_grad() if static else torch.inference_mode()


@dataclass
class StepInputs:
    """A step's slices laid out as flat token rows, decodes first (``prepare_inputs``)."""

    seqs: list[ScheduledSeq]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat cache slot of each row
    decodes: DecodeRows = field(default_factory=lambda: DecodeRows([], []))
    prefills: list[PrefillSlice] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # each sampling slice's last row
    sample_seqs: list[ScheduledSeq] = field(default_factory=list)
    prompt_rows: list[tuple[ScheduledSeq, int]] = field(default_factory=list)  # (slice, row)
    image_rows: list[tuple[ScheduledSeq, int]] = field(default_factory=list)  # (slice, row)
    # Speculative slices and the row of their first verified position (the request's last
    # token); their ``num_spec_tokens + 1`` rows are verified by ``spec`` (spec_decode/).
    verify: list[tuple[ScheduledSeq, int]] = field(default_factory=list)


def _decodes_first(seq: ScheduledSeq) -> tuple[int, int]:
    """Decodes (by context length), then speculative slices, then prefill slices."""
    if len(seq.token_ids) == 1:
        return (0, seq.start_pos)
    return (1 if seq.num_spec_tokens else 2, 0)


def _cache_readers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The innermost modules whose forward takes one layer's ``kv_cache`` (the attention
    layers), each with that argument's position."""
    found: dict[torch.nn.Module, int] = {}
    for module in model.modules():
        names = list(inspect.signature(type(module).forward).parameters)
        if "kv_cache" in names:
            found[module] = names.index("kv_cache") - 1  # after self
    inner = {m for m in found if not any(c in found for c in m.modules() if c is not m)}
    return [(m, index) for m, index in found.items() if m in inner]


def _hook_registries(model: torch.nn.Module) -> list[dict]:
    """The dicts a forward hook on ``model`` (or a global one) is registered in: a hook is
    there while any of them is not empty. Registering adds to them in place."""
    from torch.nn.modules import module as torch_module

    found: list[dict] = [torch_module._global_forward_hooks]
    found.append(torch_module._global_forward_pre_hooks)
    for m in model.modules():
        found += [m._forward_hooks, m._forward_pre_hooks]
    return found


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
        self.ops = backend.ops
        # A vision-language model encodes images with its own tower (at request admission).
        self.vision: VisionEncoder | None = None
        if config.model.is_multimodal:
            processor = ImageProcessorConfig.from_folder(config.model.path)
            self.vision = VisionEncoder(
                cast(LlavaForConditionalGeneration, self.model), processor, self.device
            )
        self.num_blocks = num_kv_blocks(config)
        m = config.model
        # The static runner pads into one more block, never handed out (its null block).
        extra = 1 if config.graph.static else 0
        # Under tensor parallelism this rank's cache holds only its kv heads.
        self.kv_heads = local_kv_heads(m.text_config["num_attention_heads"], m.num_kv_heads)
        num_kv_heads = self.kv_heads.stop - self.kv_heads.start
        shape = (num_kv_heads, self.num_blocks + extra, self.block_size, m.head_dim)
        self.kv_dtype: torch.dtype = getattr(torch, m.kv_cache_dtype)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in range(m.num_layers)
        ]
        self.generators: dict[str, torch.Generator] = {}
        # Seeded draws come from torch generators, which XLA devices do not have: theirs live
        # on the CPU (the same draws as the CPU engine's).
        self.generator_device = self.device if self.device.type in ("cpu", "cuda") else CPU
        self.static: StaticRunner | None = None
        # Speculative decoding (spec_decode/SpecDecoder), set by the engine when configured.
        self.spec: SpecDecoder | None = None
        # req_id -> prompt length: keep the logits at the prompt's last position (``outputs``).
        self.prompt_logit_taps: dict[str, int] = {}
        if config.graph.static:
            self.static = StaticRunner(config, self.model, self.kv_caches, self.num_blocks, backend)
            self.static.warm_up()
        # Steps of decode rows only in one backend call, where the backend has one for this
        # model (``Ops.decode_step``); built again when the weights it points at change.
        self.fused_decode = (
            None if self.static else self.ops.decode_step(self.model, self.kv_caches)
        )
        self._hook_registries = _hook_registries(self.model)

    def release(self, req_id: str) -> None:
        """Forgets a finished request's random state."""
        self.generators.pop(req_id, None)
        self.prompt_logit_taps.pop(req_id, None)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [block_table[p // bs] * bs + p % bs for p in range(num_tokens)], device=self.device
        )

    @torch.inference_mode()
    def export_kv(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """Copies the KV of a sequence's first ``num_tokens`` tokens out of the cache.

        Returns [2, num_layers, num_kv_heads, num_tokens, head_dim] float32 (kv_transfer.py):
        a bfloat16 cache's values exactly, which ``import_kv`` stores back without rounding.
        """
        slots = self._slots(block_table, num_tokens)
        layers = []
        for k_cache, v_cache in self.kv_caches:
            kvh, num_blocks, bs, d = k_cache.shape
            flat = num_blocks * bs
            k = k_cache.view(kvh, flat, d).index_select(1, slots)  # [kvh, T, d]
            v = v_cache.view(kvh, flat, d).index_select(1, slots)
            layers.append(torch.stack((k, v)))  # [2, kvh, T, d]
        return torch.stack(layers, dim=1).float().cpu().numpy()

    @torch.inference_mode()
    def import_kv(self, block_table: list[int], payload: KVPayload) -> None:
        """Writes a payload's tokens into the sequence's blocks (positions 0..num_tokens-1)."""
        slots = self._slots(block_table, payload.metadata.num_tokens)
        with warnings.catch_warnings():
            # A read-only view of shared memory (Ray's object store): torch only reads it.
            warnings.simplefilter("ignore", UserWarning)
            # [2, L, kvh, T, d]: this rank's heads of the model's
            kv = torch.from_numpy(payload.kv[:, :, self.kv_heads]).to(self.device, self.kv_dtype)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            kvh, num_blocks, bs, d = k_cache.shape
            k_cache.view(kvh, num_blocks * bs, d).index_copy_(1, slots, kv[0, layer])
            v_cache.view(kvh, num_blocks * bs, d).index_copy_(1, slots, kv[1, layer])

    def generator_state(self, req_id: str) -> np.ndarray | None:
        """The request's seeded generator state (None when it samples unseeded or greedily)."""
        gen = self.generators.get(req_id)
        return None if gen is None else gen.get_state().numpy().copy()

    def restore_generator(self, req_id: str, seed: int, state: np.ndarray) -> None:
        gen = torch.Generator(device=self.generator_device).manual_seed(seed)
        gen.set_state(torch.from_numpy(np.array(state, dtype=np.uint8)))
        self.generators[req_id] = gen

    @contextlib.contextmanager
    def kv_arriving(self, reads: list[KVBlockSource]) -> Iterator[set[KVBlockSource]]:
        """Forwards run inside it while ``reads`` (layer-wise block reads) are still landing:
        each attention layer first waits for its own layer's blocks of every read, so the
        copy of the later layers hides under the earlier layers' compute. Yields the set of
        reads that were not in when waited for: the step's output for their requests is
        worthless (the engine drops it); the other requests' rows never read those blocks."""
        layer_of = {k.data_ptr(): layer for layer, (k, _) in enumerate(self.kv_caches)}
        missed: set[KVBlockSource] = set()

        def wait(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
            layer = layer_of.get(kv_cache[0].data_ptr())
            if layer is None:  # another model's cache (a draft model's)
                return
            for read in reads:
                if read not in missed and not read.wait_layer(layer):
                    missed.add(read)

        hooks = [
            module.register_forward_pre_hook(
                lambda _m, args, kwargs, i=index: wait(
                    kwargs["kv_cache"] if len(args) <= i else args[i]
                ),
                with_kwargs=True,
            )
            for module, index in _cache_readers(self.model)
        ]
        try:
            yield missed
        finally:
            for hook in hooks:
                hook.remove()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with no_grad(self.static is not None):
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: scheduled slices -> inputs -> forward -> sampled tokens.

        The static runner runs forward and sampling as graphs per bucket; the eager path runs
        ``forward`` then ``sample_tokens``. Both end in ``outputs``.
        """
        step = self.prepare_inputs(out)
        if self.static is not None:
            hidden, logits, tokens, nan_rows = self._forward_and_sample_static(step)
            result = self.outputs(step, hidden, logits, tokens, nan_rows)
            if self.spec is not None:
                assert hidden is not None
                self.spec.after_forward(step, hidden, result)
            return result
        hidden, logits = self.forward(step)
        last_hidden = hidden[step.sample_rows]  # [S, H]
        # NaN anywhere in a row's hidden state poisons all its logits; checking H values per
        # row instead of V is 85x less work.
        nan_rows = torch.isnan(last_hidden).any(dim=-1)
        tokens = self.sample_tokens(step.sample_seqs, logits) if step.sample_seqs else None
        result = self.outputs(step, hidden, logits, tokens, nan_rows)
        if self.spec is not None:
            self.spec.after_forward(step, hidden, result)
        return result

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """Orders the slices (decodes first, shortest context first: the torch ops batch them
        by context length), writes imported KV and lays the step's tokens out flat."""
        step = StepInputs(seqs=sorted(out.seqs, key=_decodes_first))
        bs = self.block_size
        for seq in step.seqs:
            if isinstance(seq.kv_import, KVPayload):  # a block read lands by itself
                self.import_kv(seq.block_table, seq.kv_import)
            q_start = len(step.input_ids)
            n = len(seq.token_ids)
            pos = range(seq.start_pos, seq.start_pos + n)
            if seq.prompt_logprob_targets:
                step.prompt_rows.append((seq, q_start + seq.prompt_logprob_offset))
            if seq.mm_inputs:
                step.image_rows.append((seq, q_start))
            step.input_ids.extend(seq.token_ids)
            step.positions.extend(pos)
            step.slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            as_decodes = n == 1 or (seq.num_spec_tokens > 0 and self.ops.decode_rows_any_order)
            if as_decodes and not step.prefills:
                # A speculative slice's row i sees the keys up to its own position: the same
                # as a decode row with that context (its keys are written before attention).
                for i in range(n):
                    step.decodes.block_tables.append(seq.block_table)
                    step.decodes.context_lens.append(seq.start_pos + 1 + i)
            else:
                num_blocks = -(-(seq.start_pos + n) // bs)
                block_ids = torch.tensor(seq.block_table[:num_blocks], device=self.device)
                step.prefills.append(PrefillSlice(q_start, n, seq.start_pos, block_ids))
            if seq.num_spec_tokens:
                step.verify.append((seq, len(step.input_ids) - seq.num_spec_tokens - 1))
            elif seq.sample:
                step.sample_rows.append(len(step.input_ids) - 1)
                step.sample_seqs.append(seq)
        return step

    def forward(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over the step's tokens: hidden states [T, hidden] and the logits of the
        sampling slices' last tokens [len(sample_seqs), vocab]."""
        if self._runs_fused(step):
            assert self.fused_decode is not None
            decodes = step.decodes
            return self.fused_decode(
                step.input_ids,
                step.positions,
                step.slots,
                decodes.block_tables,
                decodes.context_lens,
            )
        ids = torch.tensor(step.input_ids, device=self.device)
        embeds = None
        if step.image_rows:
            embeds = self.model.embed_input_ids(ids)
            rows, features = self._image_features(step.image_rows)
            embeds[rows] = features.to(self.device)
        meta = self.ops.attention_metadata(
            step.slots, step.decodes, step.prefills, self.block_size, self.device
        )
        positions = torch.tensor(step.positions, device=self.device)
        hidden = self.model(ids, positions, self.kv_caches, meta, inputs_embeds=embeds)
        if not step.sample_rows:  # a step of prefill chunks only
            return hidden, hidden.new_empty(0, self.config.model.vocab_size)
        return hidden, self.model.compute_logits(hidden[step.sample_rows])

    def _runs_fused(self, step: StepInputs) -> bool:
        """Whether ``fused_decode`` takes the step: decode rows that all sample, and nothing
        that needs the modules to run (images, prompt logprobs, speculative decoding, a
        forward hook: ``kv_arriving``'s too, which waits for each layer's KV)."""
        if self.fused_decode is None or self.spec is not None:
            return False
        if step.prefills or step.image_rows or step.prompt_rows or step.verify:
            return False
        if len(step.sample_rows) != len(step.input_ids) or not step.input_ids:
            return False
        if any(self._hook_registries):  # a forward hook must see the modules run
            return False
        if not self.fused_decode.current(self.kv_caches):
            self.fused_decode = self.ops.decode_step(self.model, self.kv_caches)
        return self.fused_decode is not None

    def _forward_and_sample_static(
        self, step: StepInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        assert self.static is not None
        slices = [(s.token_ids, s.start_pos, s.block_table) for s in step.seqs]
        images = self._image_features(step.image_rows) if step.image_rows else None
        sampling = None
        if step.sample_seqs:
            batch = self._sampling_batch(step.sample_seqs, CPU)
            sampling = sampling_inputs(
                step.sample_seqs, batch, self.config.model.vocab_size, self.generator_device
            )
        # Verify slices sample in spec_decode/ from their hidden states.
        sampled_slices = [
            i for i, seq in enumerate(step.seqs) if seq.sample and not seq.num_spec_tokens
        ]
        want_hidden = bool(step.prompt_rows) or self.spec is not None
        return self.static.execute(slices, images, sampling, sampled_slices, want_hidden)

    def outputs(
        self,
        step: StepInputs,
        hidden: torch.Tensor | None,  # [T, hidden]; needed only for prompt logprobs
        logits: torch.Tensor,  # [S, V]: the sampled slices' raw logits
        tokens: torch.Tensor | None,  # [S] long
        nan_rows: torch.Tensor,  # [S] bool
    ) -> ModelRunnerOutput:
        """Prompt logprobs, the sampled tokens and their logprobs, NaN rows as failures."""
        result = ModelRunnerOutput()
        for seq, row in step.prompt_rows:
            assert hidden is not None
            result.prompt_logprobs[seq.req_id] = self._prompt_logprobs(seq, hidden, row)
        seqs = step.sample_seqs
        if not seqs:
            return result
        assert tokens is not None
        num_top = max((s.params.logprobs or 0) for s in seqs)
        if any(s.params.logprobs is not None for s in seqs):
            result.logprobs = self._logprobs(seqs, logits, tokens.to(logits.device), num_top)
        if self.prompt_logit_taps:
            self._tap_prompt_logits(seqs, logits, result)
        for seq, token, is_bad in zip(seqs, tokens.tolist(), nan_rows.tolist(), strict=True):
            if is_bad:
                result.failed[seq.req_id] = "the model produced NaN logits"
            else:
                result.sampled[seq.req_id] = token
        return result

    def _tap_prompt_logits(
        self, seqs: list[ScheduledSeq], logits: torch.Tensor, result: ModelRunnerOutput
    ) -> None:
        """Copies the raw logits of tapped requests whose slice ends at their prompt's end."""
        for row, seq in enumerate(seqs):
            prompt_len = self.prompt_logit_taps.get(seq.req_id)
            if prompt_len is not None and seq.start_pos + len(seq.token_ids) == prompt_len:
                del self.prompt_logit_taps[seq.req_id]
                result.prompt_logits[seq.req_id] = logits[row].float().cpu().numpy().copy()

    def _image_features(
        self, image_rows: list[tuple[ScheduledSeq, int]]
    ) -> tuple[list[int], torch.Tensor]:
        """The step's image placeholder rows and their features [rows, hidden] (on the CPU).

        A slice covers positions [start_pos, start_pos + n): it takes the part of each image
        inside it (a chunked prefill or a prefix-cache hit may split an image).
        """
        rows: list[int] = []
        parts: list[np.ndarray] = []
        for seq, q_start in image_rows:
            end = seq.start_pos + len(seq.token_ids)
            for m in seq.mm_inputs:
                assert m.features is not None, "the engine encodes images at admission"
                lo, hi = max(m.offset, seq.start_pos), min(m.offset + m.length, end)
                if hi <= lo:
                    continue
                parts.append(m.features.embeds[lo - m.offset : hi - m.offset])  # [hi - lo, H]
                first = q_start + lo - seq.start_pos
                rows.extend(range(first, first + hi - lo))
        hidden = self.config.model.text_config["hidden_size"]
        if not parts:
            return rows, torch.empty(0, hidden)
        return rows, torch.from_numpy(np.concatenate(parts)).float()

    def sample_tokens(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` [S, V]: [S] long (the eager sampler)."""
        batch = self._sampling_batch(seqs, self.device)
        logits = self._process_logits(seqs, logits)
        tokens = sample(logits, batch, self.ops.argmax)
        if any(s.grammar_bitmask is not None and s.params.greedy for s in seqs):
            # Greedy constrained rows were sampled unmasked: most picks are allowed as they are.
            greedy_rows = [s.grammar_bitmask if s.params.greedy else None for s in seqs]
            tokens = fix_greedy_tokens(logits, tokens, greedy_rows)
        return tokens

    def _process_logits(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """Penalties, logit_bias, allowed and banned tokens, grammar masks of the rows that do
        not sample greedily; returns ``logits`` itself (never modified in place: the logprobs
        read it) when no row asks for them."""
        raw = logits
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
        if any(s.grammar_bitmask is not None and not s.params.greedy for s in seqs):
            # Greedy rows are masked after sampling, only where needed (sample_tokens).
            sampled = [None if s.params.greedy else s.grammar_bitmask for s in seqs]
            logits = apply_grammar_bitmasks(logits, sampled)
        banned = [(row, s.banned_token_ids) for row, s in enumerate(seqs) if s.banned_token_ids]
        if banned:
            logits = logits.clone() if logits is raw else logits
            for row, ids in banned:
                logits[row, ids] = float("-inf")
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

    def _sampling_batch(self, seqs: list[ScheduledSeq], dev: torch.device) -> SamplingBatch:
        generators: list[torch.Generator | None] = []
        for seq in seqs:
            seed = seq.params.seed
            if seed is None or seq.params.greedy:
                generators.append(None)
                continue
            gen = self.generators.get(seq.req_id)
            if gen is None:
                gen = torch.Generator(device=self.generator_device).manual_seed(seed)
                self.generators[seq.req_id] = gen
            generators.append(gen)
        return SamplingBatch(
            temperature=torch.tensor([s.params.temperature for s in seqs], device=dev),
            top_k=torch.tensor([s.params.top_k for s in seqs], device=dev),
            top_p=torch.tensor([s.params.top_p for s in seqs], device=dev),
            min_p=torch.tensor([s.params.min_p for s in seqs], device=dev),
            generators=generators,
        )
