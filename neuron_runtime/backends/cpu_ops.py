"""The CPU backend's ops on the fused C kernels (backends/cpu_kernels.c).

Linear layers and the logits head run on the packed-panel GEMM over weights repacked once at
``attach``: from the GGUF file's Q4_1 / Q8_0 blocks when the model came from one (a GGUF
``quantization_config``, engine_args.py; loader.py finds the file), dequantized in registers
to the very fp32 values of the converted checkpoint, else from the fp32 weights (as bf16
panels for dtype "bfloat16"). Add+RMSNorm, SiLU-and-mul, rotary and the KV write are fused;
decodes attend in one kernel call over padded block tables. Prefill slices keep the torch path
(SDPA).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels, QuantizedPanels
from neuron_runtime.backends.ops import Ops
from neuron_runtime.layers.attention import (
    AttentionMetadata,
    DecodeRows,
    PrefillSlice,
    StepMetadata,
    attend_prefills,
    pad_tables,
)

if TYPE_CHECKING:
    from neuron_runtime.backends.cpu_decode import DecodeStep
    from neuron_runtime.gguf_convert import QuantizedTensor
    from neuron_runtime.layers.linear import Linear
    from neuron_runtime.layers.logits import LogitsHead

logger = logging.getLogger(__name__)

# GGML tensor types the kernels compute on -> the packing for them.
QUANTIZED_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


# Prefill slices of up to this many tokens attend in the decodes' kernel call, one row per
# token with its own context length: a row's attention is then the same computation whether
# the token came in a prompt or was decoded, over the keys the cache holds, on the kernels'
# threads. Longer slices take torch's SDPA, whose tiles win as a slice grows. SmolLM2's heads
# on 2 threads (AMD Zen 4), kernel against SDPA per layer: sixteen 40-token slices 0.6 ms
# against 2.0, one of 512 tokens 4.8 against 9.9, one of 1024 19 against 24.
PAGED_PREFILL_MAX_TOKENS = 512


@dataclass
class KernelAttentionMetadata(AttentionMetadata):
    """The rows that attend in one kernel call: the decodes, then each prefill slice of up to
    ``PAGED_PREFILL_MAX_TOKENS`` tokens; block tables padded to the longest context.
    ``prefills`` holds only the longer slices (SDPA)."""

    row_tables: torch.Tensor | None = None  # [rows, max_blocks] long, zero-padded
    row_lens: torch.Tensor | None = None  # [rows] long, each row's own key included
    # The rows' indices in the step where they are not its first len(row_lens) rows.
    rows: torch.Tensor | None = None


class CPUKernelOps(Ops):
    """``Ops`` on the fused CPU kernels; inputs the kernels cannot take fall back to torch."""

    name = "cpu_kernels"
    decode_rows_any_order = True  # paged_decode_attention: one block table and length per row

    def __init__(self, kernels: CPUKernels, dtype: str = "float32") -> None:
        self.kernels = kernels
        self.dtype = dtype  # ModelConfig.dtype: "bfloat16" packs bf16 panels

    def attach(self, model: nn.Module) -> None:
        """Also repacks every ``Linear`` weight into the kernels' panel layout, dropping the
        ``[out, in]`` copy: from the GGUF blocks (``quantized``) where the model's config
        names its GGUF source and the tensor's type has a kernel, else from fp32."""
        from neuron_runtime.layers.linear import Linear

        super().attach(model)
        quantized = self._quantized_linears(model)
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                panels = quantized.get(name)
                if panels is not None:
                    module.quantized = panels
                    module.packed = None
                else:
                    module.packed = self._pack_weight(module.weight)
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)

    def _quantized_linears(self, model: nn.Module) -> dict[str, QuantizedPanels]:
        """Packed GGUF blocks by Linear module name; the tied or separate lm_head's go on the
        logits head (``head.quantized``, with the weight it stands for)."""
        from neuron_runtime.gguf_convert import quantized_tensors
        from neuron_runtime.layers.linear import Linear
        from neuron_runtime.layers.logits import LogitsHead

        source = getattr(model, "gguf_file", None)  # loader.load_model, for GGUF quantization
        if source is None:
            return {}
        tensors = quantized_tensors(source)
        target = getattr(model, "checkpoint_target", lambda name: (name, None))
        parts: dict[str, list[tuple[int, QuantizedTensor]]] = {}
        for hf_name, tensor in tensors.items():
            param, shard = target(hf_name)
            parts.setdefault(param.removesuffix(".weight"), []).append((shard or 0, tensor))
        packed: dict[str, QuantizedPanels] = {}
        fp32: Counter[str] = Counter()
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name in parts:
                shards = [t for _, t in sorted(parts[name], key=lambda p: p[0])]
                panels = self._pack(shards, module.out_features, module.in_features)
                if panels is None:
                    fp32.update(t.ggml_type for t in shards)
                else:
                    packed[name] = panels
        head = getattr(model, "logits_head", None)
        head_name = "model.embed_tokens" if getattr(model, "lm_head", None) is None else "lm_head"
        head_format = ""
        if isinstance(head, LogitsHead) and head_name in parts:
            weight: torch.Tensor = model.lm_head_weight  # type: ignore[assignment]
            shards = [t for _, t in parts[head_name]]
            vocab, hidden = weight.shape
            head_panels = self._pack(shards, vocab, hidden)
            if head_panels is None:
                fp32.update(t.ggml_type for t in shards)
            else:
                head.quantized = (weight, head_panels)  # type: ignore[assignment]
                head_format = f", the logits head in {head_panels.format}"
        kinds = Counter(p.format for p in packed.values())
        logger.info(
            "CPU kernels on the GGUF blocks of %s: %s linear layers (%s)%s",
            source,
            len(packed),
            ", ".join(f"{n} {f}" for f, n in sorted(kinds.items())) or "none",
            head_format,
        )
        if fp32:
            logger.warning(
                "no CPU kernel for GGUF tensor types %s: those layers run on fp32 weights",
                ", ".join(f"{t} ({n} tensors)" for t, n in sorted(fp32.items())),
            )
        return packed

    def _pack(self, shards: list[QuantizedTensor], out: int, width: int) -> QuantizedPanels | None:
        """One Linear's GGUF tensors (its fused parts in order) as panels, or None when their
        types have no kernel, differ, or do not make up an ``[out, width]`` weight."""
        import numpy as np

        kinds = {t.ggml_type for t in shards}
        if len(kinds) != 1 or next(iter(kinds)) not in QUANTIZED_FORMATS:
            return None
        if sum(t.rows for t in shards) != out or any(t.width != width for t in shards):
            return None
        fmt = QUANTIZED_FORMATS[next(iter(kinds))]
        blocks = np.concatenate([t.blocks for t in shards]) if len(shards) > 1 else shards[0].blocks
        pack = self.kernels.pack_q4_1 if fmt == "q4_1" else self.kernels.pack_q8_0
        return pack(blocks, out, width)

    def _pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """fp32 panels, or bf16 ones for dtype "bfloat16" (an odd input width stays fp32)."""
        if self.dtype == "bfloat16" and weight.shape[1] % 2 == 0:
            return self.kernels.pack_bf16(weight)
        return self.kernels.pack(weight)

    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor | QuantizedPanels | None = layer.quantized
        if packed is None:
            packed = layer.packed
        if packed is None:  # not attached (built after the backend prepared the model)
            return F.linear(x, layer.weight, layer.bias)
        out = layer.out_features
        if x.dim() == 2:  # the model's activations are [tokens, hidden]: no reshape to undo
            return self.kernels.linear(x.contiguous(), packed, layer.bias, out)
        rows = x.reshape(-1, layer.in_features).contiguous()
        return self.kernels.linear(rows, packed, layer.bias, out).view(*x.shape[:-1], out)

    def logits(self, head: LogitsHead, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        panels = self.head_panels(head, weight)
        return self.kernels.linear(hidden.contiguous(), panels, None, weight.shape[0])

    def head_panels(self, head: LogitsHead, weight: torch.Tensor) -> torch.Tensor | QuantizedPanels:
        """The head's packed ``weight``: its GGUF blocks while it is still the weight they
        were made of, else panels packed on first use (kept in ``head.packed``)."""
        quantized = getattr(head, "quantized", None)
        if quantized is not None and quantized[0] is weight:
            return quantized[1]
        if head.packed.numel() == 0:
            head.packed = self._pack_weight(weight)
        return head.packed

    def decode_step(
        self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> DecodeStep | None:
        """A Llama-family model's decode steps in one kernel call each (backends/cpu_decode.py),
        or None for other models."""
        from neuron_runtime.backends import cpu_decode

        return cpu_decode.build(self, model, kv_caches)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.add_rms_norm(x, residual, weight, eps), x

    def act_and_mul(
        self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if act_fn is not F.silu or not gate_up.is_contiguous():
            return super().act_and_mul(gate_up, act_fn)
        return self.kernels.silu_and_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            return super().rotary(x, cos, sin)
        return self.kernels.rotary_(x, cos.view(rows, -1), sin.view(rows, -1), heads)

    def attention_metadata(
        self,
        slot_mapping: list[int],
        decodes: DecodeRows,
        prefills: list[PrefillSlice],
        block_size: int,
        device: torch.device,
    ) -> StepMetadata:
        lens, tables = list(decodes.context_lens), list(decodes.block_tables)
        rows = list(range(len(lens)))
        long_slices = []
        for p in prefills:
            if p.q_len > PAGED_PREFILL_MAX_TOKENS:
                long_slices.append(p)
                continue
            table = p.block_ids.tolist()
            tables.extend([table] * p.q_len)
            lens.extend(range(p.start_pos + 1, p.start_pos + p.q_len + 1))
            rows.extend(range(p.q_start, p.q_start + p.q_len))
        width = max((-(-n // block_size) for n in lens), default=0)
        return KernelAttentionMetadata(
            torch.tensor(slot_mapping, dtype=torch.long),
            len(decodes.context_lens),
            long_slices,
            row_tables=torch.tensor(pad_tables(tables, width), dtype=torch.long),
            row_lens=torch.tensor(lens, dtype=torch.long),
            rows=None if rows == list(range(len(rows))) else torch.tensor(rows),
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        assert isinstance(meta, KernelAttentionMetadata)
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        assert meta.row_tables is not None and meta.row_lens is not None
        n = len(meta.row_lens)
        if n:
            rows = meta.rows if meta.rows is not None else slice(0, n)
            out[rows] = self.kernels.decode_attention(
                q[rows],
                k_cache,
                v_cache,
                meta.row_tables,
                meta.row_lens,
                scale,
                sliding_window,
                softcap,
            )
        window = sliding_window
        attend_prefills(out, q, k, v, k_cache, v_cache, meta.prefills, scale, window, softcap)
        return out.view(q.shape[0], -1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if not logits.is_contiguous() or logits.dtype != torch.float32:
            return super().argmax(logits)
        return self.kernels.argmax(logits)
