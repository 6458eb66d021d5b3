"""How big the paged KV cache is, and how long a sequence it lets the engine take.

One place for the arithmetic that the engine (``ModelRunner`` allocates ``num_kv_blocks``) and
the serve builder (which checks a config in the driver, before any replica loads weights)
must agree on.

The default budget (``kv_cache_memory_bytes`` unset) holds the larger of 512 MiB and one
``max_model_len`` sequence, but never more than ``kv_cache_memory_fraction`` of the host memory
still available once the weights are loaded. A fixed floor rather than a share of all free
memory (vLLM's ``gpu_memory_utilization``) because on a host every replica, the Ray object
store and the OS share that memory: a share taken per engine would make capacity depend on
what else started first. The fraction only bounds the default, so it never takes the host.

When the budget (default or configured) cannot hold the model's own context and the user did
not ask for a ``max_model_len``, ``max_model_len`` is capped to what fits, with one warning.
A ``max_model_len`` the user asked for is never shortened: the engine refuses it instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_layout import DTYPE_BYTES

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024  # the default budget's floor
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.5
_DTYPE_BYTES = 4  # the engine loads weights in float32


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of K and V that one token takes across all layers, in a cache of ``dtype``."""
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_bytes_per_block(config: EngineConfig) -> int:
    m = config.model
    per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.kv_cache_dtype)
    return per_token * config.cache.block_size


def num_kv_blocks(config: EngineConfig) -> int:
    """The KV blocks an engine allocates for ``config`` (a block count wins over bytes)."""
    return config.cache.num_blocks or max(
        1, config.cache.kv_cache_bytes // kv_bytes_per_block(config)
    )


def kv_capacity_tokens(config: EngineConfig) -> int:
    """How many tokens the engine's KV cache holds."""
    return num_kv_blocks(config) * config.cache.block_size


@dataclass(frozen=True)
class KVPlan:
    """The resolved budget: bytes for the cache and the max_model_len it serves."""

    kv_cache_bytes: int
    max_model_len: int


def plan_kv_cache(
    *,
    bytes_per_token: int,
    block_size: int,
    model_limit: int,
    max_model_len: int | None,
    kv_cache_bytes: int | None,
    num_blocks: int | None,
    memory_fraction: float,
    available_bytes: int | None,
    weight_bytes: int,
) -> KVPlan:
    """Resolves the KV budget and max_model_len (a pure function of its arguments).

    ``max_model_len``/``kv_cache_bytes``/``num_blocks`` are the user's settings (None: unset);
    ``available_bytes`` is the host memory free now (None: unknown), before ``weight_bytes``
    are loaded.
    """
    length = model_limit if max_model_len is None else max_model_len
    block_bytes = bytes_per_token * block_size
    if kv_cache_bytes is None:
        need = -(-length // block_size) * block_bytes
        budget = max(DEFAULT_KV_CACHE_BYTES, need)
        if available_bytes is not None:
            room = int(memory_fraction * max(0, available_bytes - weight_bytes))
            budget = max(block_bytes, min(budget, room))
    else:
        budget = kv_cache_bytes
    blocks = num_blocks or max(1, budget // block_bytes)
    capacity = blocks * block_size
    if capacity < length and max_model_len is None:
        logger.warning(
            "max_model_len capped to %d tokens (the model allows %d): the KV cache holds %d "
            "blocks of %d tokens%s; set kv_cache_memory_bytes or num_kv_blocks to change it",
            capacity,
            model_limit,
            blocks,
            block_size,
            _budget_note(kv_cache_bytes, num_blocks, memory_fraction, available_bytes),
        )
        length = capacity
    return KVPlan(kv_cache_bytes=budget, max_model_len=length)


def _budget_note(
    kv_cache_bytes: int | None,
    num_blocks: int | None,
    memory_fraction: float,
    available_bytes: int | None,
) -> str:
    if num_blocks is not None:
        return " (num_kv_blocks)"
    if kv_cache_bytes is not None:
        return f" (kv_cache_memory_bytes {kv_cache_bytes})"
    gib = (available_bytes or 0) / 2**30
    return f" (kv_cache_memory_fraction {memory_fraction} of {gib:.1f} GiB available)"


def weight_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes the folder's weights take once loaded as float32 (read from the headers only).

    A shard whose header does not read counts as nothing here: the budget is an estimate, and
    loading the weights reports the broken file with its own error.
    """
    total = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                    numel = 1
                    for dim in f.get_slice(name).get_shape():
                        numel *= dim
                    total += numel * _DTYPE_BYTES
        except (OSError, SafetensorError):
            continue
    return total


def available_memory_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable, bounded by its cgroup's limit."""
    available = _meminfo_available()
    room = _cgroup_room()
    if available is None:
        return room
    return available if room is None else min(available, room)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """A cgroup v2 memory limit minus what the cgroup uses (None: no limit)."""
    try:
        with open("/proc/self/cgroup") as f:
            paths = [line.strip()[3:] for line in f if line.startswith("0::")]
    except OSError:
        return None
    for rel in [*paths, "/"]:
        folder = Path("/sys/fs/cgroup") / rel.lstrip("/")
        try:
            limit = (folder / "memory.max").read_text().strip()
            current = int((folder / "memory.current").read_text())
        except (OSError, ValueError):
            continue
        return None if limit == "max" else max(0, int(limit) - current)
    return None
