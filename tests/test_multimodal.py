"""Image helpers without a model: placeholders, content hashes in the KV hash chains, decoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from neuron_runtime.kv_cache import hash_block
from neuron_runtime.kv_transfer import TRANSFER_HASH_BLOCK_SIZE, prompt_block_hashes
from neuron_runtime.multimodal import (
    ImageFeatures,
    MultiModalInput,
    check_placeholders,
    expand_image_tokens,
    image_content_hash,
    images_in_range,
    load_image,
)

IMG = 9  # the image token of these tests


def test_expand_image_tokens_expands_single_tokens_and_keeps_expanded_runs():
    ids, spans = expand_image_tokens([1, IMG, 2, IMG, IMG, IMG, 3, IMG], IMG, 3)
    assert ids == [1, IMG, IMG, IMG, 2, IMG, IMG, IMG, 3, IMG, IMG, IMG]
    assert spans == [(1, 3), (5, 3), (9, 3)]
    assert expand_image_tokens([1, 2], IMG, 3) == ([1, 2], [])
    # Adjacent images: two single tokens, or two expanded runs.
    two = [1, IMG, IMG, IMG, IMG, IMG, IMG, 2]
    assert expand_image_tokens([1, IMG, IMG, 2], IMG, 3) == (two, [(1, 3), (4, 3)])
    assert expand_image_tokens(two, IMG, 3) == (two, [(1, 3), (4, 3)])


def test_check_placeholders_wants_each_image_on_its_own_run():
    ids = [1, IMG, IMG, 2, IMG, IMG]
    a, b = MultiModalInput(1, 2, "a"), MultiModalInput(4, 2, "b")
    assert check_placeholders(ids, [b, a], IMG, 2) == [a, b]
    with pytest.raises(ValueError, match="4 image placeholder tokens .* but 1 images"):
        check_placeholders(ids, [a], IMG, 2)
    with pytest.raises(ValueError, match=r"placeholders \[0, 2\) are not a run"):
        check_placeholders(ids, [MultiModalInput(0, 2, "a"), b], IMG, 2)
    with pytest.raises(ValueError, match="not a run"):
        check_placeholders(ids, [a, MultiModalInput(1, 2, "b")], IMG, 2)


def test_images_in_range_finds_every_image_touching_the_range():
    mm = [MultiModalInput(2, 5, "a"), MultiModalInput(8, 5, "b")]
    assert images_in_range(mm, 0, 2) == ()
    assert images_in_range(mm, 0, 4) == (("a", 2),)
    assert images_in_range(mm, 4, 8) == (("a", 2),)
    assert images_in_range(mm, 4, 9) == (("a", 2), ("b", 8))
    assert images_in_range(mm, 13, 20) == ()


def test_block_hashes_mix_in_image_content_hashes():
    assert hash_block(None, [IMG] * 4, (("a", 0),)) != hash_block(None, [IMG] * 4, (("b", 0),))
    assert hash_block(None, [IMG] * 4, (("a", 0),)) == hash_block(None, [IMG] * 4, (("a", 0),))
    assert hash_block(None, [1, 2], ()) == hash_block(None, [1, 2])

    bs = TRANSFER_HASH_BLOCK_SIZE
    ids = list(range(bs)) + [IMG] * bs + list(range(bs))
    with_a = prompt_block_hashes(ids, [MultiModalInput(bs, bs, "a")])
    with_b = prompt_block_hashes(ids, [MultiModalInput(bs, bs, "b")])
    assert with_a[0] == with_b[0] == prompt_block_hashes(ids)[0]  # the text before the image
    assert with_a[1] != with_b[1] and with_a[2] != with_b[2]  # the image block and the chain
    assert with_a == prompt_block_hashes(ids, [MultiModalInput(bs, bs, "a")])
    assert prompt_block_hashes(ids, []) == prompt_block_hashes(ids)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_load_image_decodes_to_rgb_and_refuses_corrupt_or_huge_images():
    rgba = Image.new("RGBA", (5, 4), (255, 0, 0, 0))  # fully transparent: white after RGB
    data = _png(rgba)
    img = load_image(data)
    assert img.mode == "RGB" and img.size == (5, 4)
    assert np.asarray(img).min() == 255
    assert load_image(np.zeros((4, 5, 3), np.uint8)).size == (5, 4)
    assert image_content_hash(data) == image_content_hash(bytes(data))
    with pytest.raises(ValueError, match="cannot be decoded"):
        load_image(b"not an image")
    with pytest.raises(ValueError, match="cannot be decoded"):
        load_image(data[: len(data) // 2])
    with pytest.raises(ValueError, match="more than the limit of 10"):
        load_image(data, max_pixels=10)
    with pytest.raises(ValueError, match="uint8"):
        load_image(np.zeros((4, 5, 3), np.float32))


def test_image_features_check_names_the_mismatching_field():
    feats = ImageFeatures("h", np.zeros((4, 8), np.float32), "fp")
    feats.check("fp", 4, 8)
    with pytest.raises(ValueError, match="fingerprint"):
        feats.check("other", 4, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        feats.check("fp", 5, 8)
    with pytest.raises(ValueError, match="hidden"):
        feats.check("fp", 4, 16)
    with pytest.raises(ValueError, match="dtype"):
        ImageFeatures("h", np.zeros((4, 8), np.float64), "fp").check("fp", 4, 8)
