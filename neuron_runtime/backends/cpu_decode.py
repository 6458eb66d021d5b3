"""A decode step of a Llama-family model in one kernel call (``decode_step``, cpu_kernels.c).

The module path of a decode step makes some 400 kernel calls for a 30-layer model, with
Python between each: module dispatch, views, output allocations. ``DecodeStep`` describes the
model once, as C structs pointing at its packed weights, its KV caches and a workspace, and
then runs a step of decode rows (one new token per sequence, the common step of a busy
engine) as a single call that returns the final hidden states and the logits. The kernels are
the same, called in the same order on the same inputs, so the results are the same bits
(``tests/test_cpu_decode_step.py``). The call releases the GIL for the whole step, where the
module path takes it back between every two kernels: in a served replica the event loop then
never holds up the engine mid-step.

It takes only a model whose modules would run exactly the Llama code path
(``models/llama.py``: fused q/k/v with optional bias, rotary, paged attention with an
optional window, SiLU-gated MLP, RMSNorm) on the CPU kernels without tensor parallelism.
Qwen2 and Mistral are such models; anything else (q/k norms, MoE, Gemma's scaled norms,
another activation) keeps the module path, as does any step with a prefill, an image, a
speculative slice, or a forward hook on the model.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels, QuantizedPanels
from neuron_runtime.layers.attention import pad_tables
from neuron_runtime.layers.linear import Linear
from neuron_runtime.layers.norm import RMSNorm

if TYPE_CHECKING:
    from neuron_runtime.backends.cpu_ops import CPUKernelOps

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p

# cpu_kernels.c: the weight formats decode_step's linear layers name theirs by.
_FORMATS = {"fp32": 0, "q4_1": 1, "q8_0": 2, "bf16": 3}


class _Linear(ctypes.Structure):
    _fields_ = [("packed", _ptr), ("bias", _ptr), ("in_", _i64), ("out", _i64), ("format", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("window", _i64),
        ("softcap", _f64),
    ]


_WORKSPACE = ("residual", "normed", "qkv", "attn", "mlp", "act", "out", "cos", "sin")


_SIZES = (
    "num_layers",
    "vocab",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "inter",
    "num_blocks",
    "block_size",
    "rope_positions",
    "kv_bf16",
)


class _Model(ctypes.Structure):
    _fields_ = (
        [(name, _i64) for name in _SIZES]
        + [("eps", _f64), ("scale", _f64)]
        + [(name, _ptr) for name in ("embed", "rope_cos", "rope_sin", "final_norm")]
        + [("head", _Linear), ("layers", _ptr)]
        + [(name, _ptr) for name in _WORKSPACE]
    )


# The name a step's call has in a torch profile (accuracy/profiler.py): the kernels inside
# it are not torch ops, so without it a decode step would not show up there.
PROFILE_LABEL = "cpu_kernels::decode_step"

_STEP_ERRORS = {
    -1: "no memory to round a layer's input to bf16",
    -2: "a linear layer in an unknown weight format",
    -3: "a position past the rotary table",
    -4: "a token id past the embedding",
}


def runs_llama_path(model: nn.Module) -> bool:
    """Whether every module of ``model`` would run exactly the Llama decode path, on one
    rank: what ``decode_step`` computes."""
    from neuron_runtime.models.llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
        LlamaMLP,
        LlamaModel,
    )
    from neuron_runtime.parallel.layers import ParallelLogitsHead

    def same(obj: object, cls: type, *methods: str) -> bool:
        return isinstance(obj, cls) and all(
            getattr(type(obj), m) is getattr(cls, m) for m in methods
        )

    if not same(model, LlamaForCausalLM, "forward", "compute_logits"):
        return False
    inner: Any = getattr(model, "model", None)
    if not same(inner, LlamaModel, "forward", "embed") or type(inner.norm) is not RMSNorm:
        return False
    if inner.embed_tokens.tp.size != 1:  # tensor parallel: the layers all-reduce
        return False
    head = getattr(model, "logits_head", None)
    if type(head) is not ParallelLogitsHead or head.tp.size != 1 or not len(inner.layers):
        return False
    # One eps and one attention scale for the whole model, as the structs hold them.
    norms = [inner.norm]
    norms += [n for x in inner.layers for n in (x.input_layernorm, x.post_attention_layernorm)]
    if len({n.eps for n in norms}) != 1 or len({x.self_attn.scale for x in inner.layers}) != 1:
        return False
    for layer in inner.layers:
        if not same(layer, LlamaDecoderLayer, "forward"):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        if not same(attn, LlamaAttention, "forward", "rotate_qk"):
            return False
        if not same(mlp, LlamaMLP, "forward") or mlp.act_fn is not F.silu:
            return False
        if type(layer.input_layernorm) is not RMSNorm:
            return False
        if type(layer.post_attention_layernorm) is not RMSNorm:
            return False
    return True


class DecodeStep:
    """One model's decode steps as ``decode_step`` calls (see the module docstring)."""

    def __init__(
        self,
        kernels: CPUKernels,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        head: torch.Tensor | QuantizedPanels,
    ) -> None:
        inner: Any = model.model  # runs_llama_path(model): one eps and one scale
        layers = list(inner.layers)
        first = layers[0].self_attn
        kv_heads, num_blocks, block_size, head_dim = kv_caches[0][0].shape
        self._kernels = kernels
        self._kv_caches = list(kv_caches)
        self._hidden = inner.embed_tokens.weight.shape[1]
        self._vocab = model.lm_head_weight.shape[0]
        inter = layers[0].mlp.intermediate_size_per_rank
        # What the structs point at, and where it came from: a step first checks that each
        # attribute still holds the tensor it had (weights reloaded or repacked since: rebuild).
        self._sources: list[tuple[dict[str, Any], str, object]] = []
        self._layers = (_Layer * len(layers))()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            assert k_cache.is_contiguous() and v_cache.is_contiguous()
            self._layers[i] = _Layer(
                self._tensor(layer.input_layernorm, "weight"),
                self._tensor(layer.post_attention_layernorm, "weight"),
                self._linear(attn.qkv_proj),
                self._linear(attn.o_proj),
                self._linear(mlp.gate_up_proj),
                self._linear(mlp.down_proj),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                attn.sliding_window or 0,
                attn.softcap or 0.0,
            )
        rotary = inner.rotary
        self._struct = _Model(
            num_layers=len(layers),
            vocab=inner.embed_tokens.weight.shape[0],
            hidden=self._hidden,
            heads=first.num_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            inter=inter,
            num_blocks=num_blocks,
            block_size=block_size,
            rope_positions=rotary.cos.shape[0],
            kv_bf16=int(kv_caches[0][0].dtype == torch.bfloat16),
            eps=inner.norm.eps,
            scale=first.scale,
            embed=self._tensor(inner.embed_tokens, "weight"),
            rope_cos=self._tensor(rotary, "cos"),
            rope_sin=self._tensor(rotary, "sin"),
            final_norm=self._tensor(inner.norm, "weight"),
            head=_panels(head, self._hidden, self._vocab, None),
            layers=ctypes.addressof(self._layers),
        )
        logits_head = model.logits_head
        if isinstance(head, QuantizedPanels):  # good while it is still the weight's (cpu_ops.py)
            self._watch(logits_head, "quantized")
            self._watch(inner.embed_tokens if model.lm_head is None else model.lm_head, "weight")
        else:
            self._watch(logits_head, "packed")
        self._widths = {
            "residual": self._hidden,
            "normed": self._hidden,
            "qkv": (first.num_heads + 2 * kv_heads) * head_dim,
            "attn": first.num_heads * head_dim,
            "mlp": 2 * inter,
            "act": inter,
            "out": self._hidden,
            "cos": head_dim // 2,
            "sin": head_dim // 2,
        }
        self._workspace: dict[str, torch.Tensor] = {}
        self._capacity = 0

    def current(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether every weight and cache it points at is still the model's."""
        return (
            len(kv_caches) == len(self._kv_caches)
            and all(a is b for a, b in zip(kv_caches, self._kv_caches, strict=True))
            and all(where.get(name) is value for where, name, value in self._sources)
        )

    def __call__(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows, one per sequence: the final norm's output [rows, hidden] and the
        logits [rows, vocab]."""
        rows = len(input_ids)
        if rows > self._capacity:
            self._grow(rows)
        block_size = self._struct.block_size
        width = max(-(-n // block_size) for n in context_lens)
        ids = torch.tensor(input_ids, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        slot = torch.tensor(slots, dtype=torch.int64)
        tables = torch.tensor(pad_tables(block_tables, width), dtype=torch.int64)
        lens = torch.tensor(context_lens, dtype=torch.int64)
        hidden = torch.empty(rows, self._hidden)
        logits = torch.empty(rows, self._vocab)
        with torch.profiler.record_function(PROFILE_LABEL):  # one op in a profile's table
            status = self._kernels.decode_step(
                ctypes.addressof(self._struct),
                rows,
                ids.data_ptr(),
                pos.data_ptr(),
                slot.data_ptr(),
                tables.data_ptr(),
                width,
                lens.data_ptr(),
                hidden.data_ptr(),
                logits.data_ptr(),
            )
        if status:
            error = _STEP_ERRORS.get(status, f"status {status}")
            raise (MemoryError if status == -1 else ValueError)(f"decode step: {error}")
        return hidden, logits

    def _grow(self, rows: int) -> None:
        capacity = max(rows, 2 * self._capacity, 8)
        for name, width in self._widths.items():
            buffer = self._workspace[name] = torch.empty(capacity, width)
            setattr(self._struct, name, buffer.data_ptr())
        self._capacity = capacity

    def _watch(self, owner: object, name: str) -> None:
        """Remembers the object ``owner.name`` holds now, by the dict it is kept in (a
        module's parameters, buffers or plain attributes: a dict lookup per step, not
        ``nn.Module.__getattr__``); an attribute that only has its class default is watched
        in the instance's own attributes, where setting it puts it."""
        value = getattr(owner, name)
        places = [getattr(owner, "_parameters", {}), getattr(owner, "_buffers", {}), vars(owner)]
        where = next((d for d in places if name in d), vars(owner))
        self._sources.append((where, name, value if name in where else None))

    def _tensor(self, owner: object, name: str) -> int:
        value = getattr(owner, name)
        assert isinstance(value, torch.Tensor) and value.is_contiguous()
        assert value.dtype == torch.float32 and value.device.type == "cpu"
        self._watch(owner, name)
        return value.data_ptr()

    def _linear(self, layer: Linear) -> _Linear:
        weights = layer.quantized if layer.quantized is not None else layer.packed
        assert weights is not None, "CPUKernelOps.attach packs every Linear"
        self._watch(layer, "quantized")
        self._watch(layer, "packed")
        if layer.bias is not None:
            self._tensor(layer, "bias")
        return _panels(weights, layer.in_features, layer.out_features, layer.bias)


def _panels(
    weights: torch.Tensor | QuantizedPanels, width: int, out: int, bias: torch.Tensor | None
) -> _Linear:
    """A linear layer's struct: its packed ``[out, width]`` weight (cpu_ops.py) and bias."""
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weights, QuantizedPanels):
        return _Linear(weights.data.data_ptr(), bias_ptr, width, out, _FORMATS[weights.format])
    fmt = "bf16" if weights.dtype == torch.bfloat16 else "fp32"
    return _Linear(weights.data_ptr(), bias_ptr, width, out, _FORMATS[fmt])


def build(
    ops: CPUKernelOps, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> DecodeStep | None:
    """A ``DecodeStep`` for ``model`` on ``ops``' kernels, or None where it does not run the
    Llama path (``runs_llama_path``)."""
    if not runs_llama_path(model):
        return None
    m: Any = model
    head = ops.head_panels(m.logits_head, m.lm_head_weight)
    return DecodeStep(ops.kernels, m, kv_caches, head)
