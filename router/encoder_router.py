"""The encoder stage of encode -> prefill -> decode: a request's images to vision encoders.

A request's images are deduplicated by content hash; each distinct image goes to the
VisionEncoder replica that owns its hash (rendezvous hashing, ``RendezvousRouter``), so a
repeated image, from this request or any other, reaches the replica whose cache holds it.
What comes back is a ref to the features per image: the router hands refs on to the prefill
replica and never holds the embeddings itself.

An encode call whose replica is lost (it died mid-encode, or its process is gone) is sent
again, up to ``encode_retries`` times: Serve drops a replica whose actor died from the
candidates and passes over one that does not answer its probe, so rendezvous hashing over the
replicas left sends the image to its next owner (the owner order of the others is unchanged).
"""

from __future__ import annotations

import asyncio

from ray.serve.handle import DeploymentHandle

from deployments.protocol import EncodeRequest, EncodeResult, ImagePart
from neuron_runtime import tracing
from router.migration import is_replica_lost

# Encode calls sent again after their replica was lost, and the pause before each.
ENCODE_RETRIES = 3
ENCODE_RETRY_S = 0.5


class EncoderRouter:
    def __init__(
        self,
        encoder: DeploymentHandle,
        encode_retries: int = ENCODE_RETRIES,
        retry_s: float = ENCODE_RETRY_S,
    ) -> None:
        self.encoder = encoder
        self.encode_retries = encode_retries
        self.retry_s = retry_s

    async def encode(
        self, images: list[ImagePart], trace_context: dict[str, str] | None = None
    ) -> tuple[list[ImagePart], list[EncodeResult]]:
        """The images with their features refs, and one EncodeResult per distinct image.

        ValueError (an image that does not decode) reaches the caller; if the caller is
        cancelled (client gone), every encode call still in flight is cancelled with it.
        A traced request (``trace_context``) gets one ``encoder`` span per distinct image.
        """
        distinct: dict[str, bytes] = {}
        for part in images:
            if part.features is None:
                if part.data is None:
                    raise ValueError(
                        f"image {part.content_hash[:12]} carries neither bytes nor features"
                    )
                distinct.setdefault(part.content_hash, part.data)
        if not distinct:
            return images, []
        spans = {
            key: tracing.start_span(
                "encoder", trace_context, {"neuron_serve.image.content_hash": key[:16]}
            )
            for key in distinct
        }
        calls = [
            asyncio.ensure_future(
                self._encode(EncodeRequest(key, data, tracing.inject(spans[key])))
            )
            for key, data in distinct.items()
        ]
        try:
            results: list[EncodeResult] = await asyncio.gather(*calls)
        except BaseException as exc:
            for call in calls:
                call.cancel()
            for span in spans.values():
                tracing.end(span, exc)
            raise
        for result in results:
            span = spans[result.content_hash]
            tracing.set_attributes(
                span,
                {
                    "neuron_serve.encoder.cache_hit": result.cache_hit,
                    "neuron_serve.encoder.replica": result.replica_id,
                    "neuron_serve.encoder.queue_seconds": result.queue_seconds,
                    "neuron_serve.encoder.encode_seconds": result.encode_seconds,
                    "neuron_serve.encoder.num_bytes": result.num_bytes,
                },
            )
            tracing.end(span)
        features = {r.content_hash: r.features for r in results}
        encoded = [
            part
            if part.features is not None
            else ImagePart(
                part.offset, part.length, part.content_hash, features=features[part.content_hash]
            )
            for part in images
        ]
        return encoded, results

    async def _encode(self, request: EncodeRequest) -> EncodeResult:
        """One image's encode call, sent again while its replica is lost (see the module)."""
        for attempt in range(self.encode_retries + 1):
            response = self.encoder.encode.remote(request)
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as exc:
                if attempt == self.encode_retries or not is_replica_lost(exc):
                    raise
            await asyncio.sleep(self.retry_s)
        raise AssertionError("unreachable")

    async def check_health(self) -> None:
        await self.encoder.check_health.remote()
