"""The encoder stage of encode -> prefill -> decode: a request's images to vision encoders.

A request's images are deduplicated by content hash; each distinct image goes to the
VisionEncoder replica that owns its hash (rendezvous hashing, ``RendezvousRouter``), so a
repeated image, from this request or any other, reaches the replica whose cache holds it.
What comes back is a ref to the features per image: the router hands refs on to the prefill
replica and never holds the embeddings itself.
"""

from __future__ import annotations

import asyncio

from ray.serve.handle import DeploymentHandle

from deployments.protocol import EncodeRequest, EncodeResult, ImagePart


class EncoderRouter:
    def __init__(self, encoder: DeploymentHandle) -> None:
        self.encoder = encoder

    async def encode(self, images: list[ImagePart]) -> tuple[list[ImagePart], list[EncodeResult]]:
        """The images with their features refs, and one EncodeResult per distinct image.

        ValueError (an image that does not decode) reaches the caller; if the caller is
        cancelled (client gone), every encode call still in flight is cancelled with it.
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
        responses = [
            self.encoder.encode.remote(EncodeRequest(key, data)) for key, data in distinct.items()
        ]
        try:
            results: list[EncodeResult] = await asyncio.gather(*responses)
        except BaseException:
            for response in responses:
                response.cancel()
            raise
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

    async def check_health(self) -> None:
        await self.encoder.check_health.remote()
