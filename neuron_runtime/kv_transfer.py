"""A request's KV cache handed from a prefill engine to a decode engine, as plain data.

One ``KVHandoff`` travels unchanged from the prefill engine's output to the decode engine: it
names the prompt (``KVMetadata``), the tokens already produced, the seeded sampler's state,
and where the prompt's KV is: blocks of the prefill engine's cache (``layout``,
``block_ids``), held there until the decode side has read them or a timeout frees them.
Transports add their ``ticket``; on the decode side ``kv`` is set to what the engine imports:

- a ``KVBlockSource``: reads the prefill blocks straight into blocks this engine allocates
  (NIXL; both caches must have the same layout, kv_layout.py);
- a ``KVPayload``: the tokens as one array (any block size), written into this engine's
  blocks when the request is scheduled:

      kv: [2, num_layers, num_kv_heads, num_tokens, head_dim] float32   (0 = keys, 1 = values)

- None: the decode engine recomputes the prompt (a lost or late transfer).

The importer checks every metadata field against its own model and against the prompt it is
given (the block hash chain names the exact tokens, and the images whose placeholders each
block holds): a mismatch fails that one request.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuron_runtime.config import ModelConfig
from neuron_runtime.kv_layout import KVLayout
from neuron_runtime.multimodal import MultiModalInput, images_in_range

# Hash chains for transfers are computed with this block size on both sides, whatever block
# size each engine's cache uses.
TRANSFER_HASH_BLOCK_SIZE = 16


class KVTransferError(ValueError):
    """A KV payload does not fit the engine or the request it was offered to."""


def model_fingerprint(model: ModelConfig) -> str:
    """Names the weights' architecture and shapes: sha256 of the model's config.json contents,
    and, where either is not fp32, the dtype its linear layers compute in and the one its KV
    cache holds (their KV differs)."""
    dtypes = [model.dtype, model.kv_cache_dtype]
    config = model.hf_config if dtypes == ["float32"] * 2 else [model.hf_config, *dtypes]
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_block_hashes(
    token_ids: list[int], mm_inputs: list[MultiModalInput] | None = None
) -> tuple[str, ...]:
    """The hash chain of the prompt's full transfer blocks.

    A content digest, not Python's ``hash``: it must agree between processes (on Python 3.11
    ``hash(None)`` depends on the address of ``None``, so the prefix cache's chain does not).
    A block holding image placeholders mixes in each such image's content hash and offset.
    """
    bs = TRANSFER_HASH_BLOCK_SIZE
    hashes: list[str] = []
    parent = b""
    for i in range(len(token_ids) // bs):
        block = np.asarray(token_ids[i * bs : (i + 1) * bs], dtype=np.int64).tobytes()
        if mm_inputs:
            images = images_in_range(mm_inputs, i * bs, (i + 1) * bs)
            block += "".join(f"{h}@{offset};" for h, offset in images).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent.hex())
    return tuple(hashes)


@dataclass(frozen=True)
class KVMetadata:
    """What a payload holds, checked field by field before import."""

    model_id: str
    config_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_hashes: tuple[str, ...]
    # Tail tokens past the last full transfer block, so short prompts are named too.
    tail_token_ids: tuple[int, ...] = ()
    # "content hash@offset" of every image of the prompt (the tail block's ones included).
    image_hashes: tuple[str, ...] = ()

    @classmethod
    def describe(
        cls,
        model: ModelConfig,
        token_ids: list[int],
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> KVMetadata:
        tail = len(token_ids) % TRANSFER_HASH_BLOCK_SIZE
        return cls(
            model_id=model.name or model.path,
            config_hash=model_fingerprint(model),
            dtype="float32",
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            num_tokens=len(token_ids),
            block_hashes=prompt_block_hashes(token_ids, mm_inputs),
            tail_token_ids=tuple(token_ids[len(token_ids) - tail :]) if tail else (),
            image_hashes=tuple(f"{m.content_hash}@{m.offset}" for m in mm_inputs or ()),
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)

    def check(
        self,
        model: ModelConfig,
        prompt_token_ids: list[int],
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        """Raises KVTransferError naming the first field that does not match."""
        expected = KVMetadata.describe(model, prompt_token_ids, mm_inputs)
        for name in ("config_hash", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) != getattr(expected, name):
                raise KVTransferError(
                    f"KV {name} is {getattr(self, name)!r}, this engine's model has "
                    f"{getattr(expected, name)!r} (model {self.model_id!r} vs "
                    f"{expected.model_id!r})"
                )
        if self.num_tokens != expected.num_tokens:
            raise KVTransferError(
                f"KV holds {self.num_tokens} tokens, the prompt has {expected.num_tokens}"
            )
        if self.image_hashes != expected.image_hashes:
            raise KVTransferError("KV was computed for other images")
        if (self.block_hashes, self.tail_token_ids) != (
            expected.block_hashes,
            expected.tail_token_ids,
        ):
            raise KVTransferError("KV was computed for other prompt tokens")


@dataclass
class KVPayload:
    """The KV of a prompt's first ``metadata.num_tokens`` tokens."""

    metadata: KVMetadata
    kv: np.ndarray  # [2, num_layers, num_kv_heads, num_tokens, head_dim] float32

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes)

    def check(
        self,
        model: ModelConfig,
        prompt_token_ids: list[int],
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        """Raises KVTransferError naming the first field that does not match."""
        self.metadata.check(model, prompt_token_ids, mm_inputs)
        got = self.metadata
        if self.kv.dtype != np.float32 or tuple(self.kv.shape) != got.shape:
            raise KVTransferError(
                f"KV payload array is {self.kv.dtype} {tuple(self.kv.shape)}, its metadata "
                f"says float32 {got.shape}"
            )


class KVBlockSource(ABC):
    """A transfer that reads a handed-off prompt's KV blocks straight into this engine's cache.

    The engine calls ``start`` once, from its loop thread, with the blocks it allocated for
    the prompt (in prompt order, ``ceil(num_tokens / block_size)`` of them), then ``poll``
    each step until it returns True; the request runs only then, unless the source is
    ``layer_wise``: then it runs in the very step that started the read, its forward calling
    ``wait_layer(i)`` before layer i's attention, and its output counts only if ``poll``
    returns True after that forward. Until ``poll`` has returned True or raised, the
    transfer may still write into those blocks, so the engine keeps them out of the free pool
    even if the request ends meanwhile.
    """

    metadata: KVMetadata
    layout: KVLayout  # the source cache's layout (the engine checks that it matches its own)
    # On a failed read: recompute the prompt in place (True) or end the request with an error.
    recompute_on_failure: bool = True
    # The outcome, for the owner's metrics: when the blocks were all in (time.perf_counter()),
    # or why the read failed.
    done_at: float | None = None
    error: str | None = None
    # Set by the owner: called (once, from the engine's thread) when the request's first step
    # here starts, its blocks all in or, layer-wise, landing into that step. The owner may
    # pass the news on (the PD router releases the first token then: the second follows it
    # by one step). It must not block.
    on_first_step: Callable[[], None] | None = None

    @abstractmethod
    def start(self, block_ids: list[int]) -> None:
        """Posts the read into ``block_ids``; returns at once."""

    @abstractmethod
    def poll(self) -> bool:
        """True once every block has arrived; KVTransferError if the read failed or is late."""

    # Whether the blocks arrive layer by layer and ``wait_layer`` says when one layer's are in.
    layer_wise: bool = False

    def wait_layer(self, layer: int) -> bool:
        """Blocks (briefly) until ``layer``'s part of every block has arrived; False if it has
        not (the read failed or is slow). Only for a ``layer_wise`` source."""
        raise NotImplementedError

    def abandon(self) -> None:
        """The owner's request ended; a read that never started lets its source go now."""
        return None

    @property
    def num_bytes(self) -> int:
        num_blocks = -(-self.metadata.num_tokens // self.layout.block_size)
        return (
            num_blocks
            * self.layout.num_regions
            * self.layout.num_kv_heads
            * (self.layout.block_bytes)
        )


@dataclass
class DraftHidden:
    """What an EAGLE head drafts from after a handed-off prompt: the target's hidden states at
    prompt positions ``start`` .. ``num_tokens - 1`` (``start``: the first position the prefill
    engine computed, after its prefix-cache hit). One row per position, float32:

        hidden: [num_tokens - start, F]   F = hidden size (EAGLE-3: three layers' inputs, 3x)
    """

    start: int
    hidden: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.hidden.nbytes)


# What a decode engine takes a handed-off prompt's KV from: the request carries it until the
# scheduler admits it; the engine then starts a block read itself, the runner writes a payload.
KVImport = KVPayload | KVBlockSource


@dataclass
class KVHandoff:
    """One sequence handed from a prefill engine to a decode engine (see the module docstring).

    The prefill engine sets everything but ``ticket`` and ``kv``; its blocks ``block_ids``
    stay held under ``handoff_id`` until ``LLMEngine.release_kv(handoff_id)``.
    """

    metadata: KVMetadata
    # The tokens the prefill side already produced and returned (the first token, so far).
    output_token_ids: list[int]
    # The seeded random generator's state after those tokens (None: unseeded or greedy), so
    # seeded sampling continues exactly as it would have in one engine.
    generator_state: np.ndarray | None = None
    handoff_id: str = ""
    layout: KVLayout | None = None
    block_ids: tuple[int, ...] = ()
    ticket: Any = None  # the transport's plain-data ticket (deployments/kv_transport.py)
    # The prefill engine's EAGLE proposer state (it has an EAGLE head): the decode engine's
    # head drafts from it in the request's first step there. None for other proposers.
    draft_hidden: DraftHidden | None = None
    # Decode side only, never sent: what the engine takes the prompt's KV from.
    kv: KVImport | None = None

    @property
    def num_kv_bytes(self) -> int:
        """Bytes of the prompt's KV in the prefill engine's blocks."""
        if self.layout is None:
            return 0
        layout = self.layout
        return len(self.block_ids) * layout.num_regions * layout.num_kv_heads * layout.block_bytes
