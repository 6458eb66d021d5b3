"""Images in prompts: decoding, CLIP preprocessing, placeholders and the vision encoder.

A prompt names each image by a run of ``tokens_per_image`` placeholder tokens; the engine
feeds the image's features (``[tokens_per_image, lm_hidden]``, from the vision tower and
projector) in place of those tokens' embeddings. Features cross processes as numpy arrays in
``ImageFeatures``, named by the image's content hash, which the prefix cache and the KV
transfer hash chain mix into every block the placeholders touch.

This module imports no torch until a ``VisionEncoder`` is built, so the HTTP edge can use the
image helpers alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from neuron_runtime.models.llava import LlavaForConditionalGeneration

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

RawImage = Image.Image | bytes | np.ndarray


def image_content_hash(data: bytes) -> str:
    """sha256 hex of the encoded image bytes: the name of an image everywhere."""
    return hashlib.sha256(data).hexdigest()


def hash_image(image: RawImage) -> str:
    """The content hash of an image given as bytes (as ``image_content_hash``), a PIL image
    or a uint8 array (a digest of its mode, size and pixels)."""
    if isinstance(image, bytes):
        return image_content_hash(image)
    if isinstance(image, np.ndarray):
        header = f"ndarray:{image.dtype}:{image.shape}:".encode()
        return image_content_hash(header + np.ascontiguousarray(image).tobytes())
    header = f"pil:{image.mode}:{image.size}:".encode()
    return image_content_hash(header + image.tobytes())


def load_image(image: RawImage, max_pixels: int | None = None) -> Image.Image:
    """An RGB PIL image; ValueError for corrupt data or more than ``max_pixels`` pixels.

    Encoded bytes are checked from their header before the pixels are decoded. Transparency
    is composited onto white, as transformers' ``convert_rgb`` does.
    """
    img: Image.Image
    if isinstance(image, bytes):
        try:
            img = Image.open(io.BytesIO(image))  # reads the header only
        except (OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"image data cannot be decoded: {exc}") from None
        _check_pixels(img, max_pixels)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as exc:
            raise ValueError(f"image data cannot be decoded: {exc}") from None
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(
                f"image arrays must be uint8 [H, W] or [H, W, C], got {image.dtype} {image.shape}"
            )
        img = Image.fromarray(image)
    elif isinstance(image, Image.Image):
        img = image
    else:
        raise ValueError(f"an image must be bytes, a PIL image or an array, got {type(image)}")
    _check_pixels(img, max_pixels)
    return to_rgb(img)


def _check_pixels(img: Image.Image, max_pixels: int | None) -> None:
    width, height = img.size
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"image is {width}x{height} pixels, more than the limit of {max_pixels}")


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _height_width(size: Any) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    return int(size["height"]), int(size["width"])


@dataclass(frozen=True)
class ImageProcessorConfig:
    """CLIPImageProcessor's steps and numbers (``preprocessor_config.json``).

    Resize (shortest edge to ``shortest_edge`` keeping the aspect ratio, or to ``size``),
    center crop (zero padding when smaller), rescale, normalize; channels first.
    """

    do_resize: bool = True
    shortest_edge: int | None = 224
    size: tuple[int, int] | None = None  # (height, width) when resizing to a fixed size
    resample: int = Image.Resampling.BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.do_resize and (self.shortest_edge is None) == (self.size is None):
            raise ValueError("resizing needs exactly one of shortest_edge and size")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if min(self.crop_size) < 1:
            raise ValueError(f"crop_size must be positive, got {self.crop_size}")

    @classmethod
    def from_folder(cls, path: str | Path) -> ImageProcessorConfig:
        # transformers 5 writes the image processor inside processor_config.json.
        file, combined = (
            Path(path) / "preprocessor_config.json",
            Path(path) / "processor_config.json",
        )
        if file.is_file():
            cfg = json.loads(file.read_text())
        elif combined.is_file() and "image_processor" in json.loads(combined.read_text()):
            cfg = json.loads(combined.read_text())["image_processor"]
        else:
            raise ValueError(f"{path} has no preprocessor_config.json (the image processor)")
        size = cfg.get("size", {"shortest_edge": 224})
        # An int size is a shortest edge for CLIP (default_to_square=False).
        shortest = size if isinstance(size, int) else size.get("shortest_edge")
        return cls(
            do_resize=cfg.get("do_resize", True),
            shortest_edge=shortest,
            size=None if shortest is not None else _height_width(size),
            resample=cfg.get("resample", Image.Resampling.BICUBIC),
            do_center_crop=cfg.get("do_center_crop", True),
            crop_size=_height_width(cfg.get("crop_size", 224)),
            do_rescale=cfg.get("do_rescale", True),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            do_normalize=cfg.get("do_normalize", True),
            image_mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)),
            do_convert_rgb=cfg.get("do_convert_rgb", True),
        )

    def preprocess(self, images: list[Image.Image]) -> np.ndarray:
        """[B, 3, H, W] float32 pixel values, the numbers CLIPImageProcessor gives."""
        return np.stack([self._one(img) for img in images])

    def _one(self, img: Image.Image) -> np.ndarray:
        if self.do_convert_rgb:
            img = to_rgb(img)
        if self.do_resize:
            height, width = self.size or self._shortest_edge_size(img.height, img.width)
            img = img.resize((width, height), resample=self.resample)
        pixels = np.asarray(img)  # [H, W, 3] uint8
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop_size)
        # As transformers: rescale in float64, then float32 for the normalization.
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)
            std = np.array(self.image_std, dtype=np.float32)
            pixels = (pixels - mean) / std
        return pixels.transpose(2, 0, 1)

    def _shortest_edge_size(self, height: int, width: int) -> tuple[int, int]:
        assert self.shortest_edge is not None
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if height > width else (self.shortest_edge, new_long)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The central [height, width] window, zero-padded (centered) where the image is smaller."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), pixels.dtype)
        top, left = -(-(padded.shape[0] - h) // 2), -(-(padded.shape[1] - w) // 2)
        padded[top : top + h, left : left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """One image's features in the LM's embedding space; crosses processes (object store)."""

    content_hash: str
    embeds: np.ndarray  # [num_tokens, lm_hidden] float32
    fingerprint: str  # of the vision tower + projector config that produced them

    def check(self, fingerprint: str, num_tokens: int, hidden: int) -> None:
        """ValueError naming the first field that does not fit the consuming model."""
        if self.fingerprint != fingerprint:
            raise ValueError(
                f"image features fingerprint is {self.fingerprint!r}, this model's vision "
                f"encoder is {fingerprint!r}: they come from another vision tower or projector"
            )
        if self.embeds.dtype != np.float32:
            raise ValueError(f"image features dtype is {self.embeds.dtype}, expected float32")
        if self.embeds.ndim != 2 or self.embeds.shape[0] != num_tokens:
            raise ValueError(
                f"image features num_tokens is {self.embeds.shape[:-1]}, expected {num_tokens}"
            )
        if self.embeds.shape[1] != hidden:
            raise ValueError(f"image features hidden is {self.embeds.shape[1]}, expected {hidden}")


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One image of one prompt: where its placeholders are, and its features or pixels."""

    offset: int  # first placeholder position in the prompt ids
    length: int  # number of placeholder tokens
    content_hash: str
    features: ImageFeatures | None = None  # precomputed (an encoder deployment)
    image: RawImage | None = None  # raw: the engine encodes it at admission


def images_overlapping(
    mm_inputs: list[MultiModalInput], start: int, end: int
) -> list[MultiModalInput]:
    """The images with placeholders in positions [start, end)."""
    return [m for m in mm_inputs if m.offset < end and m.offset + m.length > start]


def images_in_range(
    mm_inputs: list[MultiModalInput], start: int, end: int
) -> tuple[tuple[str, int], ...]:
    """(content hash, offset) of each image with placeholders in positions [start, end)."""
    return tuple((m.content_hash, m.offset) for m in images_overlapping(mm_inputs, start, end))


def expand_image_tokens(
    token_ids: list[int], image_token_id: int, tokens_per_image: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """(expanded ids, [(offset, length)] per image).

    A run of ``k * tokens_per_image`` image tokens is ``k`` images already expanded; any other
    run of ``k`` image tokens is ``k`` adjacent images of one token each, expanded here.
    """
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            out.append(token_ids[i])
            i += 1
            continue
        run = i
        while run < n and token_ids[run] == image_token_id:
            run += 1
        length = run - i
        num_images = length // tokens_per_image if length % tokens_per_image == 0 else length
        for _ in range(num_images):
            spans.append((len(out), tokens_per_image))
            out.extend([image_token_id] * tokens_per_image)
        i = run
    return out, spans


def place_images(
    token_ids: list[int], image_token_id: int, tokens_per_image: int, num_images: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """``expand_image_tokens``, then ValueError unless the prompt holds one image per image
    given (text that spells the image token, or a template that drops image parts)."""
    ids, spans = expand_image_tokens(token_ids, image_token_id, tokens_per_image)
    if len(spans) != num_images:
        raise ValueError(
            f"the prompt has {len(spans)} image placeholders but {num_images} images were given"
        )
    return ids, spans


def check_placeholders(
    prompt_ids: list[int],
    mm_inputs: list[MultiModalInput],
    image_token_id: int,
    tokens_per_image: int,
) -> list[MultiModalInput]:
    """The inputs in prompt order; ValueError unless they cover the prompt's image tokens
    exactly, ``tokens_per_image`` placeholders each."""
    mm_inputs = sorted(mm_inputs, key=lambda m: m.offset)
    num_placeholders = prompt_ids.count(image_token_id)
    if num_placeholders != len(mm_inputs) * tokens_per_image:
        raise ValueError(
            f"the prompt has {num_placeholders} image placeholder tokens "
            f"({tokens_per_image} per image) but {len(mm_inputs)} images were given"
        )
    end = 0
    for m in mm_inputs:
        span = prompt_ids[m.offset : m.offset + m.length]
        if m.length != tokens_per_image:
            raise ValueError(
                f"an image has {m.length} placeholders, the model takes {tokens_per_image}"
            )
        if m.offset < end or len(span) != m.length or any(t != image_token_id for t in span):
            raise ValueError(
                f"image placeholders [{m.offset}, {m.offset + m.length}) are not a run of image "
                "tokens of their own in the prompt"
            )
        end = m.offset + m.length
    return mm_inputs


@dataclass(frozen=True)
class VisionSpec:
    """How a vision-language model's prompts hold images."""

    image_token_id: int
    tokens_per_image: int


def vision_spec(cfg: dict[str, Any]) -> VisionSpec | None:
    """From a completed config alone (no weights); None for a text-only model."""
    if "vision_config" not in cfg:
        return None
    from neuron_runtime.models.llava import tokens_per_image  # llava imports this module

    return VisionSpec(int(cfg["image_token_index"]), tokens_per_image(cfg))


def vision_fingerprint(cfg: dict[str, Any]) -> str:
    """Names a LLaVA model's image side: its vision tower, feature selection and projector."""
    keys = (
        "vision_config",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "projector_hidden_act",
        "multimodal_projector_bias",
    )
    named = {key: cfg.get(key) for key in keys}
    named["lm_hidden"] = cfg["text_config"]["hidden_size"]
    text = json.dumps(named, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class VisionEncoder:
    """Vision tower + projector of a LLaVA folder: images -> features for the prompt.

    ``from_pretrained`` reads only the image side's weights (never the LM's); an engine wraps
    the model it already loaded instead.
    """

    def __init__(
        self, model: LlavaForConditionalGeneration, processor: ImageProcessorConfig, device: Any
    ) -> None:
        self.model = model
        self.processor = processor
        self.device = device
        self.tokens_per_image: int = model.tokens_per_image
        self.image_token_id: int = model.image_token_id
        self.hidden_size: int = int(model.config["text_config"]["hidden_size"])
        self.fingerprint = vision_fingerprint(model.config)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu") -> VisionEncoder:
        import torch

        from neuron_runtime.loader import iter_weights, load_hf_config
        from neuron_runtime.models.llava import LlavaForConditionalGeneration

        cfg = load_hf_config(path)
        if "vision_config" not in cfg:
            raise ValueError(f"{path} is not a vision-language model (no vision_config)")
        model = LlavaForConditionalGeneration(cfg, language_model=False)
        model.load_weights(iter_weights(path, keep=model.wants_weight))
        dev = torch.device(device)
        return cls(model.to(dev).eval(), ImageProcessorConfig.from_folder(path), dev)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """[B, 3, H, W] float32 pixels -> [B, tokens_per_image, hidden_size] float32."""
        import torch

        with torch.inference_mode():
            pixels = torch.as_tensor(pixel_values, dtype=torch.float32, device=self.device)
            return self.model.encode_images(pixels).float().cpu().numpy()

    def encode_images(self, images: list[Image.Image]) -> list[np.ndarray]:
        """One [tokens_per_image, hidden_size] float32 array per image."""
        if not images:
            return []
        return list(self.encode(self.processor.preprocess(images)))

    def features(self, mm_inputs: list[MultiModalInput]) -> list[MultiModalInput]:
        """The inputs with features: raw images encoded (in one batch), features checked."""
        raw = [m for m in mm_inputs if m.features is None]
        if any(m.image is None for m in raw):
            raise ValueError("each image input needs its features or the image itself")
        embeds = self.encode_images([load_image(m.image) for m in raw])  # type: ignore[arg-type]
        encoded = {
            id(m): ImageFeatures(m.content_hash, e, self.fingerprint)
            for m, e in zip(raw, embeds, strict=True)
        }
        out = []
        for m in mm_inputs:
            if m.features is None:
                out.append(replace(m, features=encoded[id(m)], image=None))
                continue
            if m.features.content_hash != m.content_hash:
                raise ValueError(
                    f"image features are of image {m.features.content_hash[:12]}, the input "
                    f"names image {m.content_hash[:12]}"
                )
            m.features.check(self.fingerprint, m.length, self.hidden_size)
            out.append(m)
        return out
