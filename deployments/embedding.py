"""The embedding deployment: one EmbeddingEngine per replica (``/v1/embeddings``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ray import serve


@dataclass
class EmbeddingReply:
    embeddings: np.ndarray  # [N, dimensions] float32; crosses Ray as numpy (zero-copy)
    num_prompt_tokens: list[int]


@serve.deployment(
    name="EmbeddingServer",
    ray_actor_options={"num_cpus": 0.5},
    max_ongoing_requests=16,
)
class EmbeddingServer:
    """Embeds batches of texts or token id lists; ``engine_cls`` lets tests inject a fake."""

    def __init__(
        self, model: str = "all-minilm-l6-v2", engine_cls: type | None = None, **engine_kwargs: Any
    ) -> None:
        torch.set_num_threads(1)
        if engine_cls is None:
            from neuron_runtime.embedding import EmbeddingEngine

            engine_cls = EmbeddingEngine
        self.engine = engine_cls(model=model, num_threads=1, **engine_kwargs)

    def info(self) -> dict[str, Any]:
        return {
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "dimensions": self.engine.dimensions,
        }

    async def embed(
        self, inputs: list[str] | list[list[int]], normalize: bool = True
    ) -> EmbeddingReply:
        """ValueError (empty input, too long, bad ids) reaches the caller unchanged."""
        # The forward pass runs off the event loop so health checks stay answered.
        result = await asyncio.to_thread(self.engine.embed, inputs, normalize)
        return EmbeddingReply(result.embeddings, list(result.num_prompt_tokens))
