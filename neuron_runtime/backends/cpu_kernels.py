"""Fused CPU kernels (``cpu_kernels.c``): compiled on first use, called through ctypes.

``kernels()`` returns them, or None when they are off: ``NEURON_CPU_KERNELS=0``, no C compiler
(``$CC``, else ``cc``), or a failed build (warned once). Every caller keeps its torch path for
None, so the engine runs the same everywhere, only slower without them.

The shared library is cached under ``$NEURON_SERVE_CACHE/kernels``, keyed by the source, the
compiler flags and the CPU's feature flags (it is built for this CPU, ``-march=native``).
The object is compiled with ``-ffast-math`` (vectorized ``expf``, reordered sums) but linked
without it, so loading the library does not switch the process to flush-to-zero floats.

The kernels run on a pool of threads inside the library (one per process, since ``kernels()``
is built once), sized by ``CPUKernels.set_num_threads``; results do not depend on its size.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from neuron_runtime.model_store import cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11", "-pthread"]
BUILD_TIMEOUT_S = 120

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_LINEAR: list[type] = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]  # x, packed, bias, y, m, in, out
_SIGNATURES = {
    "packed_linear": _LINEAR,
    "packed_linear_q4_1": _LINEAR,
    "packed_linear_q8_0": _LINEAR,
    "add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "silu_and_mul": [_ptr, _ptr, _i64, _i64],
    "rotary_in_place": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64],
    "write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "paged_decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
    + [_i64] * 7
    + [_f32, _i64, _f32, _i64],
    "argmax_rows": [_ptr, _i64, _i64, _ptr],
    "set_num_threads": [_i64],
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, target: Path) -> None:
    """Compiles SOURCE into ``target`` atomically (replicas may build at the same time)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, "-shared", "-pthread", str(obj), "-o", str(lib), "-lm"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        os.replace(lib, target)


# The element types the kernels read and write KV caches in.
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16)

QBLOCK = 32  # inputs per GGUF block (Q4_1, Q8_0)
# GGUF block bytes and packed record bytes per (panel, k-block), as in cpu_kernels.c.
_GGUF_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_RECORD_BYTES = {"q4_1": 768, "q8_0": 1152}


@dataclass(frozen=True)
class QuantizedPanels:
    """A Linear weight ``[out, in]`` kept in its GGUF quantization, packed for ``linear``:
    ``data`` is uint8 ``[ceil(out / PANEL), in / QBLOCK, record bytes]`` (cpu_kernels.c)."""

    format: str  # "q4_1" or "q8_0"
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _gguf_blocks(blocks: np.ndarray | bytes, fmt: str, out: int, width: int) -> np.ndarray:
    """The raw GGUF blocks of an ``[out, width]`` tensor as uint8 ``[panels * PANEL, width /
    QBLOCK, block bytes]``, rows past ``out`` zero (their weights are 0)."""
    if width % QBLOCK:
        raise ValueError(f"{fmt} rows must be a multiple of {QBLOCK} long, got {width}")
    size = _GGUF_BLOCK_BYTES[fmt]
    raw = np.frombuffer(blocks, dtype=np.uint8) if isinstance(blocks, bytes) else blocks
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != out * (width // QBLOCK) * size:
        raise ValueError(f"{raw.size} bytes of {fmt} blocks do not hold a [{out}, {width}] tensor")
    panels = -(-out // CPUKernels.PANEL)
    padded = np.zeros((panels * CPUKernels.PANEL, width // QBLOCK, size), dtype=np.uint8)
    padded[:out] = raw.reshape(out, width // QBLOCK, size)
    return padded


def _fp16_as_fp32_bytes(halves: np.ndarray) -> np.ndarray:
    """``[..., 2]`` bytes of fp16 values as ``[..., 4]`` bytes of the same values in fp32."""
    values = np.ascontiguousarray(halves).view(np.float16)[..., 0].astype(np.float32)
    return values.view(np.uint8).reshape(*values.shape[:-1], -1)


class CPUKernels:
    """Tensor-level wrappers; inputs must be contiguous fp32 CPU tensors (asserted)."""

    PANEL = 32  # output columns per packed panel, as in cpu_kernels.c

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        for name in ("num_threads", "has_bf16"):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [], _i64
        lib.packed_linear_bf16.argtypes = _LINEAR
        lib.packed_linear_bf16.restype = _i64
        # model, rows, ids, positions, slots, tables, table width, lens, hidden, logits
        lib.decode_step.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
        lib.decode_step.restype = _i64
        self._lib = lib
        # Whether this CPU runs bf16 dot products natively (AVX512_BF16) and the library was
        # built with them: pack_bf16's panels need it.
        self.has_bf16 = bool(lib.has_bf16())

    def set_num_threads(self, n: int) -> None:
        """Sizes the kernels' thread pool to ``n`` threads, the calling one included.

        Workers are created here and live until the next resize; between kernel calls they
        spin for a tenth of a millisecond, then sleep, so an idle engine costs no CPU.
        """
        if n < 1:
            raise ValueError(f"num_threads must be >= 1, got {n}")
        self._lib.set_num_threads(n)

    def num_threads(self) -> int:
        """The pool's size (fewer than asked when the system refused a thread)."""
        return int(self._lib.num_threads())

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """A Linear weight ``[out, in]`` as ``[ceil(out / PANEL), in, PANEL]`` panels for
        ``linear``: each panel holds PANEL output columns, input-major, zero-padded."""
        out, width = weight.shape
        panels = -(-out // cls.PANEL)
        padded = weight.detach().float().new_zeros(panels * cls.PANEL, width)
        padded[:out] = weight.detach()
        return padded.view(panels, cls.PANEL, width).transpose(1, 2).contiguous()

    @classmethod
    def pack_bf16(cls, weight: torch.Tensor) -> torch.Tensor:
        """A Linear weight ``[out, in]`` (``in`` even) rounded to bf16 (to nearest even) as
        ``[ceil(out / PANEL), in / 2, PANEL, 2]`` panels for ``linear``: for each pair of
        inputs, PANEL columns' two weights side by side (cpu_kernels.c, packed_linear_bf16)."""
        out, width = weight.shape
        if width % 2:
            raise ValueError(f"bf16 panels need an even input width, got {width}")
        panels = -(-out // cls.PANEL)
        padded = weight.detach().new_zeros(panels * cls.PANEL, width, dtype=torch.bfloat16)
        padded[:out] = weight.detach()
        return padded.view(panels, cls.PANEL, width // 2, 2).permute(0, 2, 1, 3).contiguous()

    @classmethod
    def pack_q4_1(cls, blocks: np.ndarray | bytes, out: int, width: int) -> QuantizedPanels:
        """The Q4_1 blocks of a GGUF tensor ``[out, width]`` (row-major, ``width / 32`` blocks
        of 20 bytes per row: fp16 scale, fp16 min, 16 bytes of nibbles) as panels for
        ``linear``."""
        raw = _gguf_blocks(blocks, "q4_1", out, width)
        panels, nb = raw.shape[0] // cls.PANEL, raw.shape[1]
        # [panel, k-block, column, 20]
        per_col = raw.reshape(panels, cls.PANEL, nb, 20).transpose(0, 2, 1, 3)
        scales = _fp16_as_fp32_bytes(per_col[..., 0:2])  # [panel, k-block, 32 * 4]
        mins = _fp16_as_fp32_bytes(per_col[..., 2:4])
        nibbles = per_col[..., 4:20]  # byte i: input i (low), input i + 16 (high)
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [.., column, input]
        q = q.transpose(0, 1, 3, 2)  # [panel, k-block, input, column]
        half = cls.PANEL // 2
        packed_q = q[..., :half] | (q[..., half:] << 4)  # column j low, j + 16 high
        record = np.concatenate([scales, mins, packed_q.reshape(panels, nb, -1)], axis=-1)
        return QuantizedPanels("q4_1", _aligned(record), out, width)

    @classmethod
    def pack_q8_0(cls, blocks: np.ndarray | bytes, out: int, width: int) -> QuantizedPanels:
        """The Q8_0 blocks of a GGUF tensor ``[out, width]`` (``width / 32`` blocks of 34 bytes
        per row: fp16 scale, 32 int8) as panels for ``linear``."""
        raw = _gguf_blocks(blocks, "q8_0", out, width)
        panels, nb = raw.shape[0] // cls.PANEL, raw.shape[1]
        per_col = raw.reshape(panels, cls.PANEL, nb, 34).transpose(0, 2, 1, 3)
        scales = _fp16_as_fp32_bytes(per_col[..., 0:2])
        q = per_col[..., 2:].transpose(0, 1, 3, 2)  # [panel, k-block, input, column]
        record = np.concatenate([scales, q.reshape(panels, nb, -1)], axis=-1)
        return QuantizedPanels("q8_0", _aligned(record), out, width)

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor | QuantizedPanels,
        bias: torch.Tensor | None,
        out: int,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` [m, in] and ``packed = pack(weight)`` (or
        ``pack_bf16`` of it: ``x`` rounded to bf16 too, fp32 sums; or ``pack_q4_1`` /
        ``pack_q8_0`` of its GGUF blocks); [m, out]."""
        if isinstance(packed, QuantizedPanels):
            return self._quantized_linear(x, packed, bias, out)
        assert x.is_contiguous() and packed.is_contiguous() and packed.data_ptr() % 64 == 0
        assert bias is None or bias.is_contiguous()
        rows, width = x.shape
        y = x.new_empty(rows, out)
        args = (
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            width,
            out,
        )
        if packed.dtype == torch.bfloat16:  # x is rounded to bf16 inside
            assert self.has_bf16 and x.dtype == torch.float32
            assert packed.shape == (-(-out // self.PANEL), width // 2, self.PANEL, 2)
            if self._lib.packed_linear_bf16(*args) != 0:
                raise MemoryError(f"no memory to round a [{rows}, {width}] input to bf16")
        else:
            assert packed.shape == (-(-out // self.PANEL), width, self.PANEL)
            self._lib.packed_linear(*args)
        return y

    def _quantized_linear(
        self, x: torch.Tensor, packed: QuantizedPanels, bias: torch.Tensor | None, out: int
    ) -> torch.Tensor:
        assert x.is_contiguous() and x.dtype == torch.float32
        assert bias is None or bias.is_contiguous()
        rows, width = x.shape
        assert out == packed.out_features and width == packed.in_features
        y = x.new_empty(rows, out)
        fn = (
            self._lib.packed_linear_q4_1
            if packed.format == "q4_1"
            else self._lib.packed_linear_q8_0
        )
        fn(
            x.data_ptr(),
            packed.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            width,
            out,
        )
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += residual`` in place (when given); returns ``rms_norm(x) * weight``."""
        assert x.is_contiguous() and (residual is None or residual.is_contiguous())
        out = torch.empty_like(x)
        hidden = x.shape[-1]
        self._lib.add_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // hidden,
            hidden,
            eps,
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[T, 2 * I]`` tensor holding gate then up; ``[T, I]``."""
        assert gate_up.is_contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
    ) -> torch.Tensor:
        """Rotates heads ``[0, heads)`` of ``x`` [T, H, d] in place; cos/sin [T, d/2]."""
        rows, _, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d and cos.is_contiguous()
        assert sin.is_contiguous()
        self._lib.rotary_in_place(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, x.stride(0), d
        )
        return x

    def write_kv(
        self,
        k: torch.Tensor,  # [T, kvh, d], rows may be strided
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [kvh, num_blocks, block_size, d] float32 or bfloat16
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] long
    ) -> None:
        """Stores this step's keys and values at their flat cache slots (rounded to nearest
        even into a bfloat16 cache, as ``Tensor.to`` rounds)."""
        rows, kv_heads, d = k.shape
        for t in (k, v):
            assert t.stride(2) == 1 and t.stride(1) == d and t.dtype == torch.float32
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        self._lib.write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            rows,
            kv_heads,
            d,
            k_cache.shape[1] * k_cache.shape[2],
            _cache_bf16(k_cache, v_cache),
        )

    def decode_attention(
        self,
        q: torch.Tensor,  # [n, heads, d], rows may be strided
        k_cache: torch.Tensor,  # [kvh, num_blocks, block_size, d] float32 or bfloat16
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [n, max_blocks] long
        context_lens: torch.Tensor,  # [n] long
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """One token per sequence over its paged cache; returns ``[n, heads, d]``."""
        n, heads, d = q.shape
        kv_heads, num_blocks, block_size, _ = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == d
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.dtype == context_lens.dtype == torch.int64
        assert block_tables.is_contiguous() and context_lens.is_contiguous()
        out = q.new_empty(n, heads, d)
        self._lib.paged_decode_attention(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            n,
            heads,
            kv_heads,
            d,
            num_blocks,
            block_size,
            block_tables.shape[1],
            scale,
            sliding_window or 0,
            softcap or 0.0,
            _cache_bf16(k_cache, v_cache),
        )
        return out

    def decode_step(self, model: int, rows: int, *pointers: int) -> int:
        """``decode_step`` of cpu_kernels.c on a model struct at address ``model`` (built by
        backends/cpu_decode.py, which owns its layout); its status, 0 for done."""
        return int(self._lib.decode_step(model, rows, *pointers))

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a ``[rows, cols]`` tensor of finite values; ``[rows]`` long."""
        assert x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        rows, cols = x.shape
        assert cols > 0
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.argmax_rows(x.data_ptr(), rows, cols, out.data_ptr())
        return out


def _aligned(record: np.ndarray) -> torch.Tensor:
    """A copy of ``record`` in a torch buffer (64-byte aligned, as torch allocates)."""
    data = torch.empty(record.shape, dtype=torch.uint8)
    data.numpy()[...] = record
    return data


def default_num_threads() -> int:
    """The cores this process may run on (its CPU affinity), the size of an engine's pools
    when nothing sized them (a serving replica sizes them from its CPU allotment)."""
    return len(os.sched_getaffinity(0))


def _cache_bf16(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernels' cache format: 1 for bfloat16 elements, 0 for float32."""
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_CACHE_DTYPES
    return int(k_cache.dtype == torch.bfloat16)


@functools.cache
def kernels() -> CPUKernels | None:
    """The compiled kernels, built on first call; None when off or unbuildable."""
    if os.environ.get("NEURON_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        warnings.warn("no C compiler found: the CPU backend uses its torch kernels", stacklevel=2)
        return None
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(COMPILE_FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not target.is_file():
            _build(compiler, target)
        return CPUKernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        warnings.warn(
            f"building the CPU kernels failed ({exc}; {detail.decode(errors='replace')[-500:]}):"
            " the CPU backend uses its torch kernels",
            stacklevel=2,
        )
        return None
