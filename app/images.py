"""Image inputs at the edge: ``image_url`` content parts turned into checked, encoded bytes.

Everything here distrusts the client. A ``data:`` URL is size-checked before its base64 is
decoded; an http(s) URL is fetched only from an allowlisted host whose resolved addresses are
all public, from the address that was checked (no second lookup an attacker could answer
differently), without redirects, within a time limit and a byte limit. The bytes are then
probed: format and dimensions come from the header, so a decompression bomb is refused
before any pixel is decoded. Failures raise ImageInputError, whose text names no internals.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from dataclasses import dataclass

import httpx
from PIL import Image

from neuron_runtime.multimodal import image_content_hash

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_FORMAT_NAMES = "PNG, JPEG, WEBP, GIF or BMP"


@dataclass(frozen=True)
class ImageLimits:
    """Caps on image inputs; remote URLs are refused unless ``allowed_domains`` names hosts."""

    max_image_bytes: int = 10 * 2**20
    max_pixels: int = 4096 * 4096
    max_side: int = 8192
    max_images_per_request: int = 8
    fetch_timeout_s: float = 10.0
    # Hosts (ASCII/punycode) whose images may be fetched, subdomains included; empty: none.
    allowed_domains: tuple[str, ...] = ()
    # Lets URLs reach loopback/private addresses: only for tests against 127.0.0.1.
    allow_private_networks: bool = False

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_pixels", "max_side", "max_images_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if isinstance(self.allowed_domains, str):
            raise ValueError("allowed_domains must be a tuple of host names, not one string")


@dataclass(frozen=True)
class ImageData:
    """An image as received (still encoded), with what its header says."""

    data: bytes
    content_hash: str
    format: str
    width: int
    height: int


class ImageInputError(ValueError):
    """A refused image input: 400 (or 413 for too many bytes), ``param`` names the field."""

    def __init__(self, message: str, param: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code


def check_image_count(count: int, limits: ImageLimits, param: str = "messages") -> None:
    """Refuse a request holding more images than ``max_images_per_request``."""
    if count > limits.max_images_per_request:
        raise ImageInputError(
            f"at most {limits.max_images_per_request} images per request, got {count}", param
        )


async def load_image_url(url: str, limits: ImageLimits, param: str) -> ImageData:
    """The image an ``image_url`` names: a ``data:`` URL or a fetched http(s) URL."""
    if url[:5].lower() == "data:":
        return parse_data_url(url, limits, param)
    return await fetch_image(url, limits, param)


# -- bytes ----------------------------------------------------------------------------------


def probe_image(data: bytes, limits: ImageLimits, param: str) -> ImageData:
    """Check encoded image bytes against ``limits``; no pixel is decoded before that.

    Format and dimensions come from the header, so unknown or disallowed formats and images
    over ``max_side`` or ``max_pixels`` are refused undecoded. Only an image within those
    bounds gets the integrity check, which catches truncated and corrupt files.
    """
    if len(data) > limits.max_image_bytes:
        raise _too_large(limits, param)
    # PIL's plugins raise many exception types on hostile input (OSError, SyntaxError,
    # struct.error, ...); all of them mean "not a valid image", and none of their text
    # (which may quote the bytes) reaches the client.
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as image:
            image_format, (width, height) = image.format, image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # PIL's own guard (its MAX_IMAGE_PIXELS, read here, never changed) fires only when
        # max_pixels is set above it; the warning raises only under `-W error`.
        raise ImageInputError(f"{param}: image has too many pixels to decode", param) from exc
    except Exception as exc:  # noqa: BLE001 - see above
        raise ImageInputError(f"{param} is not a valid {_FORMAT_NAMES} image", param) from exc
    if image_format == "MPO":  # multi-picture JPEG, as phone cameras write
        image_format = "JPEG"
    if image_format not in ALLOWED_FORMATS:
        raise ImageInputError(f"{param} is not a valid {_FORMAT_NAMES} image", param)
    if width < 1 or height < 1 or max(width, height) > limits.max_side:
        raise ImageInputError(
            f"{param}: image sides must be between 1 and {limits.max_side} pixels, "
            f"got {width}x{height}",
            param,
        )
    if width * height > limits.max_pixels:
        raise ImageInputError(f"{param}: image has more than {limits.max_pixels} pixels", param)
    try:
        _check_integrity(data, image_format)
    except Exception as exc:  # noqa: BLE001 - as for Image.open
        raise ImageInputError(f"{param} is a corrupt or truncated image", param) from exc
    return ImageData(data, image_content_hash(data), image_format, width, height)


def _check_integrity(data: bytes, image_format: str) -> None:
    # Runs only once the dimensions are known to be within limits, so the work is bounded.
    # PNG's verify() walks every chunk and its CRC without inflating; for the other formats
    # verify() checks nothing, so the first frame is decoded (JPEG at 1/8 scale).
    with Image.open(io.BytesIO(data), formats=(image_format,)) as image:
        if image_format == "PNG":
            image.verify()
        else:
            image.draft(None, (1, 1))
            image.load()


def _too_large(limits: ImageLimits, param: str) -> ImageInputError:
    return ImageInputError(
        f"{param}: image is larger than {limits.max_image_bytes} bytes", param, status_code=413
    )


# -- data: URLs -----------------------------------------------------------------------------


def parse_data_url(url: str, limits: ImageLimits, param: str) -> ImageData:
    """Decode ``data:image/<format>;base64,<payload>`` and probe the image it holds."""
    header, comma, payload = url.partition(",")
    header = header.lower()
    if not (header.startswith("data:") and header.endswith(";base64") and comma):
        raise ImageInputError(f"{param} must be a data:image/...;base64, URL", param)
    if not header.startswith("data:image/"):
        raise ImageInputError(f"{param}: the data URL's media type must be image/*", param)
    # Every 4 base64 characters carry 3 bytes: refuse an oversized payload undecoded.
    if len(payload) > 4 * -(-limits.max_image_bytes // 3):
        raise _too_large(limits, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ImageInputError(f"{param}: the data URL holds invalid base64", param) from exc
    if not data:
        raise ImageInputError(f"{param}: the data URL is empty", param)
    return probe_image(data, limits, param)


# -- http(s) URLs ---------------------------------------------------------------------------


async def fetch_image(url: str, limits: ImageLimits, param: str) -> ImageData:
    """Download an allowlisted http(s) image and probe it.

    The host is resolved once and every address must be public (unless
    ``allow_private_networks``); the request then goes to the checked address itself, with
    the original Host header and TLS server name, so a second DNS answer cannot redirect it.
    """
    target = _checked_url(url, limits, param)
    host = target.raw_host.decode("ascii")
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            address = await _resolve_public(host, target.port, target.scheme, limits, param)
            data = await _download(target, address, limits, param)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise ImageInputError(
            f"{param}: fetching the image took longer than {limits.fetch_timeout_s} s", param
        ) from exc
    except httpx.HTTPError as exc:
        raise ImageInputError(f"{param}: the image URL could not be fetched", param) from exc
    return probe_image(data, limits, param)


def _checked_url(url: str, limits: ImageLimits, param: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ImageInputError(f"{param} is not a valid URL", param) from exc
    if target.scheme not in ("http", "https") or not target.raw_host:
        raise ImageInputError(f"{param} must be a data:, http or https URL", param)
    if target.userinfo:
        raise ImageInputError(f"{param}: URLs with credentials are not accepted", param)
    if not _host_allowed(target.raw_host.decode("ascii"), limits.allowed_domains):
        raise ImageInputError(
            f"{param}: remote image URLs are only fetched from the configured allowed domains",
            param,
        )
    return target


def _host_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for domain in allowed_domains:
        domain = domain.lower().strip(".")
        if domain and (host == domain or host.endswith("." + domain)):
            return True
    return False


async def _resolve_public(
    host: str, port: int | None, scheme: str, limits: ImageLimits, param: str
) -> str:
    """The address to connect to, after checking every address the host resolves to."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            host, port or (443 if scheme == "https" else 80), type=socket.SOCK_STREAM
        )
    except (OSError, UnicodeError) as exc:
        raise ImageInputError(
            f"{param}: the image URL's host could not be resolved", param
        ) from exc
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise ImageInputError(f"{param}: the image URL's host could not be resolved", param)
    if not limits.allow_private_networks and not all(map(_is_public, addresses)):
        raise ImageInputError(
            f"{param}: the image URL's host resolves to a loopback, private, link-local or "
            f"reserved address",
            param,
        )
    return addresses[0]


def _is_public(text: str) -> bool:
    address = ipaddress.ip_address(text.split("%")[0])  # drop an IPv6 zone ("fe80::1%eth0")
    if isinstance(address, ipaddress.IPv6Address):
        # ::ffff:10.0.0.1 and 6to4 2002:0a00:0001:: reach the IPv4 address they embed.
        address = address.ipv4_mapped or address.sixtofour or address
    return address.is_global and not (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


async def _download(target: httpx.URL, address: str, limits: ImageLimits, param: str) -> bytes:
    headers = {"Host": target.netloc.decode("ascii"), "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": target.raw_host.decode("ascii")}
    # trust_env=False: no proxy from the environment (it would resolve the host itself).
    async with (
        httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=limits.fetch_timeout_s
        ) as client,
        client.stream(
            "GET", target.copy_with(host=address), headers=headers, extensions=extensions
        ) as response,
    ):
        if response.is_redirect:
            raise ImageInputError(
                f"{param}: the image URL redirects; redirects are not followed", param
            )
        if response.status_code != 200:
            raise ImageInputError(
                f"{param}: the image URL answered HTTP {response.status_code}", param
            )
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limits.max_image_bytes:
            raise _too_large(limits, param)
        # Raw bytes, counted as they arrive: a missing or false Content-Length, or a
        # compressed body that would inflate, cannot push past the cap.
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limits.max_image_bytes:
                raise _too_large(limits, param)
    return bytes(body)
