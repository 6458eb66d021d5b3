"""A request's KV cache as plain data: exported by a prefill engine, imported by a decode engine.

The payload is one numpy array plus a metadata dataclass, so it crosses processes through any
transport (Ray's object store reads it zero-copy) without pickling torch tensors:

    kv: [2, num_layers, num_kv_heads, num_tokens, head_dim] float32   (0 = keys, 1 = values)

Tokens, not blocks, are the unit: the two engines may have different block sizes or free
blocks, so the decode side writes the tokens into whatever blocks it allocates.

The importer checks every metadata field against its own model and against the prompt it is
given (the block hash chain names the exact tokens, and the images whose placeholders each
block holds): a mismatch fails that one request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from neuron_runtime.config import ModelConfig
from neuron_runtime.multimodal import MultiModalInput, images_in_range

# Hash chains for transfers are computed with this block size on both sides, whatever block
# size each engine's cache uses.
TRANSFER_HASH_BLOCK_SIZE = 16


class KVTransferError(ValueError):
    """A KV payload does not fit the engine or the request it was offered to."""


def model_fingerprint(model: ModelConfig) -> str:
    """Names the weights' architecture and shapes: sha256 of the model's config.json contents."""
    text = json.dumps(model.hf_config, sort_keys=True, default=str)
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
        expected = KVMetadata.describe(model, prompt_token_ids, mm_inputs)
        got = self.metadata
        for name in ("config_hash", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(got, name) != getattr(expected, name):
                raise KVTransferError(
                    f"KV payload {name} is {getattr(got, name)!r}, this engine's model has "
                    f"{getattr(expected, name)!r} (model {got.model_id!r} vs {expected.model_id!r})"
                )
        if got.num_tokens != expected.num_tokens:
            raise KVTransferError(
                f"KV payload holds {got.num_tokens} tokens, the prompt has {expected.num_tokens}"
            )
        if got.image_hashes != expected.image_hashes:
            raise KVTransferError("KV payload was computed for other images")
        if (got.block_hashes, got.tail_token_ids) != (
            expected.block_hashes,
            expected.tail_token_ids,
        ):
            raise KVTransferError("KV payload was computed for other prompt tokens")
        if self.kv.dtype != np.float32 or tuple(self.kv.shape) != got.shape:
            raise KVTransferError(
                f"KV payload array is {self.kv.dtype} {tuple(self.kv.shape)}, its metadata "
                f"says float32 {got.shape}"
            )


@dataclass
class KVHandoff:
    """Everything a decode engine needs to continue a request that a prefill engine began.

    ``payload`` None means "recompute": the decode engine runs the prompt itself (a lost or
    late transfer) and continues from the tokens already produced.
    """

    payload: KVPayload | None
    # Per sequence (index i of n): the tokens the prefill side already produced and returned.
    output_token_ids: list[list[int]]
    # Per sequence: its seeded random generator's state after those tokens (None: unseeded),
    # so seeded sampling continues exactly as it would have in one engine.
    generator_states: list[np.ndarray | None] = field(default_factory=list)

    def generator_state(self, index: int) -> np.ndarray | None:
        return self.generator_states[index] if index < len(self.generator_states) else None
