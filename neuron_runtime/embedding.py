"""EmbeddingEngine: one vector per input text from an encoder model (``/v1/embeddings``).

No scheduler and no KV cache: each input is a single forward pass, so the engine only
tokenizes, groups inputs of similar length into padded batches, runs the encoder and pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from neuron_runtime.backends import get_backend
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.registry import model_class
from neuron_runtime.pooling import POOLERS, l2_normalize, pooling_mode
from neuron_runtime.tokenizer import Tokenizer

# Architectures whose forward(input_ids [B, S], attention_mask [B, S]) returns [B, S, hidden].
EMBEDDING_ARCHITECTURES = ("BertModel",)


@dataclass(frozen=True)
class EmbeddingResult:
    """Embeddings in input order and how many tokens each input took."""

    embeddings: np.ndarray  # [N, dimensions] float32
    num_prompt_tokens: list[int]


class EmbeddingEngine:
    """Embeds texts (or token ids) with an encoder model and the pooling its folder declares.

    >>> engine = EmbeddingEngine("all-minilm-l6-v2")
    >>> engine.embed(["A cat sits on the mat."]).embeddings.shape
    (1, 384)
    """

    def __init__(
        self,
        model: str = "all-minilm-l6-v2",
        max_batch_size: int = 32,
        num_threads: int | None = None,
        device: str = "cpu",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        path = resolve_model(model)
        hf_config = load_hf_config(path)
        architecture = (hf_config.get("architectures") or [""])[0]
        if architecture not in EMBEDDING_ARCHITECTURES:
            raise ValueError(
                f"model {model!r} ({architecture or 'no architecture'}) cannot embed; "
                f"supported architectures: {list(EMBEDDING_ARCHITECTURES)}"
            )
        self.model_name = model
        self.max_batch_size = max_batch_size
        self.max_model_len = int(hf_config["max_position_embeddings"])
        self.dimensions = int(hf_config["hidden_size"])
        self.pooling = pooling_mode(path)
        self.tokenizer = Tokenizer(path)
        self.backend = get_backend(device, num_threads)
        self.model: Any = self.backend.prepare_model(
            load_model(model_class(architecture), hf_config, path)
        )

    def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        normalize: bool = True,
        truncate: bool = False,
    ) -> EmbeddingResult:
        """Embed every input; rows of the result follow the input order.

        Inputs longer than ``max_model_len`` tokens raise ValueError unless ``truncate``,
        which keeps the first ``max_model_len`` tokens (special tokens kept for texts).
        """
        token_ids = self._tokenize(inputs, truncate)
        embeddings = np.empty((len(token_ids), self.dimensions), dtype=np.float32)
        # Similar lengths share a batch, so little compute goes to padding.
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        for start in range(0, len(order), self.max_batch_size):
            batch = order[start : start + self.max_batch_size]
            embeddings[batch] = self._embed_batch([token_ids[i] for i in batch], normalize)
        return EmbeddingResult(embeddings, [len(ids) for ids in token_ids])

    def _tokenize(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], truncate: bool
    ) -> list[list[int]]:
        if (
            isinstance(inputs, str)
            or not inputs
            or not all(isinstance(x, (str, Sequence)) for x in inputs)
        ):
            raise ValueError("inputs must be a non-empty list of strings or of token id lists")
        texts = [x for x in inputs if isinstance(x, str)]
        id_lists = [list(x) for x in inputs if not isinstance(x, str)]
        if texts and id_lists:
            raise ValueError("inputs must be all strings or all token id lists, not a mix")
        limit = self.max_model_len if truncate else None
        for index, text in enumerate(texts):
            if not text:
                raise ValueError(f"input {index} is an empty string")
        vocab_size = self.tokenizer.vocab_size
        for index, ids in enumerate(id_lists):
            if not ids:
                raise ValueError(f"input {index} has no token ids")
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
                raise ValueError(f"input {index} has token ids outside [0, {vocab_size})")
        if texts:
            token_ids = self.tokenizer.encode_batch(texts, max_length=limit)
        else:
            token_ids = [ids[:limit] for ids in id_lists]
        for index, ids in enumerate(token_ids):
            if len(ids) > self.max_model_len:
                raise ValueError(
                    f"input {index} is {len(ids)} tokens long, over max_model_len "
                    f"{self.max_model_len}; shorten it or pass truncate=True"
                )
        return token_ids

    @torch.inference_mode()
    def _embed_batch(self, token_ids: list[list[int]], normalize: bool) -> np.ndarray:
        lengths = torch.tensor([len(ids) for ids in token_ids])
        padded_len = int(lengths.max())
        input_ids = torch.zeros(len(token_ids), padded_len, dtype=torch.long)  # [B, S]
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
        mask = torch.arange(padded_len) < lengths[:, None]  # [B, S], right padding
        device = self.backend.device
        input_ids, mask = input_ids.to(device), mask.to(device)
        pooled = POOLERS[self.pooling](self.model(input_ids, mask), mask)  # [B, hidden]
        if normalize:
            pooled = l2_normalize(pooled)
        return pooled.float().cpu().numpy()
