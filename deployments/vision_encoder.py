"""The vision encoder deployment: images in, projected embeddings out by object ref.

Each replica loads only the vision tower and projector of the model folder. Images from
concurrent requests are batched (``@serve.batch``) through preprocessing and the tower; the
result is put in the object store once and the ref handed out, so the router never copies
embeddings and the prefill replica reads them zero-copy. An LRU cache keyed by the image's
content hash holds those refs (bounded in bytes): a repeated image costs no encoding and no
copy. The encoder router sends an image to the replica that owns its hash (rendezvous
hashing, router/request_routers.py), so repeats land on the cache that holds them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import ray
import torch
from ray import ObjectRef, serve
from ray.serve.exceptions import RayServeException

from deployments.profiling import ProfiledReplica
from deployments.protocol import EncodeRequest, EncodeResult
from neuron_runtime import tracing
from neuron_runtime.model_store import resolve_model
from neuron_runtime.multimodal import ImageFeatures, VisionEncoder, load_image


class EmbeddingCache:
    """content hash -> (ref to ImageFeatures, bytes): least recently used out first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[ObjectRef, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[ObjectRef, int] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, ref: ObjectRef, num_bytes: int) -> None:
        if num_bytes > self.max_bytes or key in self._entries:
            return
        self._entries[key] = (ref, num_bytes)
        self.num_bytes += num_bytes
        while self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted


@serve.deployment(
    name="VisionEncoder",
    ray_actor_options={"num_cpus": 0.25},
    max_ongoing_requests=32,
    health_check_period_s=5,
    health_check_timeout_s=10,
)
class VisionEncoderServer(ProfiledReplica):
    def __init__(
        self,
        model: str,
        cache_mib: int = 256,
        max_batch_size: int = 8,
        batch_wait_timeout_s: float = 0.005,
        max_pixels: int = 4096 * 4096,
        tracing_config: dict[str, Any] | None = None,
    ) -> None:
        tracing.configure(tracing_config, "encoder")
        torch.set_num_threads(1)
        self.encoder = VisionEncoder.from_pretrained(resolve_model(model))
        self.cache = EmbeddingCache(cache_mib << 20)
        self.max_pixels = max_pixels
        self.profile_backend = self.encoder.device.type
        batch: Any = self._encode_batch  # serve.batch adds setters its type does not declare
        batch.set_max_batch_size(max_batch_size)
        batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        # Images being encoded: a second request for one waits for the first's result.
        self._pending: dict[str, asyncio.Future[EncodeResult]] = {}
        self.num_queries = 0
        self.num_hits = 0
        self.num_encoded = 0
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except (RuntimeError, RayServeException):  # outside a replica (unit tests)
            self.replica_id = "local"

    async def encode(self, request: EncodeRequest) -> EncodeResult:
        """The image's features (ValueError when its bytes do not decode).

        A traced request gets a ``vision_encoder`` span saying whether the cache held the
        image, and for an image encoded here ``encoder.queue`` (waiting for a batch) and
        ``encoder.compute`` (the batch through preprocessing, tower and projector).
        """
        attributes = {"neuron_serve.encoder.replica": self.replica_id}
        span = tracing.start_span("vision_encoder", request.trace_context, attributes)
        async with tracing.ending(span):
            arrival_ns = tracing.now_ns()
            result = await self._encode_or_reuse(request)
            tracing.set_attributes(
                span,
                {
                    "neuron_serve.encoder.cache_hit": result.cache_hit,
                    "neuron_serve.encoder.num_bytes": result.num_bytes,
                },
            )
            if span is not None and not result.cache_hit:
                queued_ns = arrival_ns + int(result.queue_seconds * 1e9)
                computed_ns = queued_ns + int(result.encode_seconds * 1e9)
                tracing.record_span("encoder.queue", span, arrival_ns, queued_ns)
                tracing.record_span("encoder.compute", span, queued_ns, computed_ns)
        return result

    async def _encode_or_reuse(self, request: EncodeRequest) -> EncodeResult:
        self.num_queries += 1
        key = request.content_hash
        cached = self.cache.get(key)
        if cached is not None:
            self.num_hits += 1
            return EncodeResult(key, cached[0], cached[1], True, 0.0, 0.0, self.replica_id)
        pending = self._pending.get(key)
        if pending is not None:
            self.num_hits += 1
            result = await asyncio.shield(pending)
            return EncodeResult(
                key, result.features, result.num_bytes, True, 0.0, 0.0, self.replica_id
            )
        future: asyncio.Future[EncodeResult] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            result = await self._encode(request)
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning without waiters
            else:
                future.cancel()
            raise
        else:
            future.set_result(result)
            return result
        finally:
            del self._pending[key]

    async def _encode(self, request: EncodeRequest) -> EncodeResult:
        arrival = time.perf_counter()
        # Shielded: a caller that goes away must not cancel the batch other callers share.
        out = await asyncio.shield(self._encode_batch(request.data))
        if isinstance(out, Exception):  # this image did not decode
            raise out
        embeds, started, seconds = out
        features = ImageFeatures(request.content_hash, embeds, self.encoder.fingerprint)
        ref = ray.put(features)
        self.cache.put(request.content_hash, ref, embeds.nbytes)
        self.num_encoded += 1
        return EncodeResult(
            request.content_hash,
            ref,
            embeds.nbytes,
            False,
            max(0.0, started - arrival),
            seconds,
            self.replica_id,
        )

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _encode_batch(
        self, images: list[bytes]
    ) -> list[tuple[np.ndarray, float, float] | Exception]:
        started = time.perf_counter()
        # The tower runs off the event loop so health checks and cache hits stay answered.
        results = await asyncio.to_thread(self._encode_sync, images)
        seconds = time.perf_counter() - started
        return [r if isinstance(r, Exception) else (r, started, seconds) for r in results]

    def _encode_sync(self, images: list[bytes]) -> list[np.ndarray | Exception]:
        """Decodes each image on its own (one bad image fails only its request), then runs the
        good ones through the tower as one batch."""
        decoded: list[Any] = []
        for data in images:
            try:
                decoded.append(load_image(data, self.max_pixels))
            except ValueError as exc:
                decoded.append(exc)
        good = [image for image in decoded if not isinstance(image, Exception)]
        embeds = iter(self.encoder.encode_images(good) if good else [])
        return [image if isinstance(image, Exception) else next(embeds) for image in decoded]

    def stats(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "num_pending": len(self._pending),
            "num_cached": len(self.cache),
            "cache_bytes": self.cache.num_bytes,
            "mm_cache_queries": self.num_queries,
            "mm_cache_hits": self.num_hits,
            "num_encoded": self.num_encoded,
        }

    def check_health(self) -> None:
        """Serve's health probe: the replica answers (the tower has no loop of its own)."""
