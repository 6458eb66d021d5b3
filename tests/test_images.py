"""app/images.py against real PIL-made images and a real HTTP server on 127.0.0.1
(RELIABILITY.md cases 8-10: corrupt images, bombs, oversized inputs, SSRF-shaped URLs)."""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import io
import socket
import ssl
import struct
import threading
import time
import tracemalloc
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import certifi
import pytest
from PIL import Image, ImageFile

from app import images
from app.images import (
    ImageInputError,
    ImageLimits,
    check_image_count,
    fetch_image,
    load_image_url,
    parse_data_url,
    probe_image,
)

PARAM = "messages[1].content[0].image_url"


def encoded(image_format: str, size: tuple[int, int] = (64, 48)) -> bytes:
    image = Image.new("RGB", size, (200, 30, 90))
    image.putpixel((3, 4), (0, 255, 0))
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height, with (almost) no pixel data behind it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def refused(info: pytest.ExceptionInfo, status_code: int, param: str = PARAM) -> str:
    """Assert a sanitized refusal and return its message."""
    exc = info.value
    message = str(exc)
    assert exc.status_code == status_code
    assert exc.param == param
    cause = exc.__cause__
    if cause is not None and str(cause):
        assert str(cause) not in message
    for leak in ("Traceback", "PIL", "site-packages", ".py", "\\x", "Errno", "httpx", "httpcore"):
        assert leak not in message
    return message


# -- bytes and data: URLs -------------------------------------------------------------------


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_valid_images_probe_without_changing_bytes(image_format):
    data = encoded(image_format)
    image = parse_data_url(data_url(data, f"image/{image_format.lower()}"), ImageLimits(), PARAM)
    assert (image.format, image.width, image.height) == (image_format, 64, 48)
    assert image.data == data
    assert image.content_hash == hashlib.sha256(data).hexdigest()


async def test_load_image_url_dispatches_data_urls():
    data = encoded("JPEG")
    image = await load_image_url(data_url(data, "image/jpeg"), ImageLimits(), PARAM)
    assert (image.format, image.data) == ("JPEG", data)


@pytest.mark.parametrize(
    "data",
    [
        b"not an image at all",
        b"\x89PNG\r\n\x1a\n" + b"\xff" * 64,
        b"",
        encoded("TIFF"),  # a real image, but not an allowed format
    ],
    ids=["garbage", "png-signature-garbage", "empty", "tiff"],
)
def test_corrupt_or_disallowed_bytes_are_400(data):
    with pytest.raises(ImageInputError) as info:
        probe_image(data, ImageLimits(), PARAM)
    assert "not a valid" in refused(info, 400)


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_truncated_images_are_400(image_format):
    data = encoded(image_format, (256, 256))
    with pytest.raises(ImageInputError) as info:
        probe_image(data[: len(data) * 2 // 3], ImageLimits(), PARAM)
    refused(info, 400)


def test_too_many_bytes_is_413():
    data = encoded("PNG")
    with pytest.raises(ImageInputError) as info:
        probe_image(data, ImageLimits(max_image_bytes=len(data) - 1), PARAM)
    refused(info, 413)


@pytest.fixture
def pixel_loads(monkeypatch):
    """Every ImageFile.load() call made while the test runs."""
    calls = []
    original = ImageFile.ImageFile.load

    def load(self):
        calls.append(self.size)
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


@pytest.mark.parametrize(
    "width, height, limits",
    [
        (30000, 30000, ImageLimits()),  # PIL's own bomb guard fires in Image.open
        (8000, 8000, ImageLimits()),  # sides within max_side, pixels over max_pixels
        (9000, 16, ImageLimits()),  # one side over max_side
        (30000, 30000, ImageLimits(max_pixels=10**10, max_side=10**6)),  # only PIL refuses
    ],
)
def test_decompression_bomb_is_refused_from_the_header(width, height, limits, pixel_loads):
    bomb = png_header_only(width, height)
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ImageInputError) as info:
        probe_image(bomb, limits, PARAM)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    refused(info, 400)
    assert pixel_loads == []
    assert elapsed < 0.5
    assert peak < 2 * 2**20


def test_pil_bomb_warning_as_error_is_a_400(pixel_loads):
    # 10000 x 10000 is past PIL's warning threshold but below its error threshold.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImageInputError) as info:
            probe_image(png_header_only(10000, 10000), ImageLimits(max_side=10**5), PARAM)
    assert "pixels" in refused(info, 400)
    assert pixel_loads == []


def test_oversized_base64_is_refused_before_decoding(monkeypatch):
    decoded = []
    monkeypatch.setattr(images.base64, "b64decode", lambda *a, **k: decoded.append(a))
    limits = ImageLimits(max_image_bytes=3000)
    with pytest.raises(ImageInputError) as info:
        parse_data_url("data:image/png;base64," + "A" * 4004, limits, PARAM)
    refused(info, 413)
    assert decoded == []


def test_base64_at_the_byte_limit_is_decoded():
    data = encoded("PNG")
    image = parse_data_url(data_url(data), ImageLimits(max_image_bytes=len(data)), PARAM)
    assert image.data == data


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,!!!!",
        "data:image/png;base64,iVBORw0KGgo=garbage",
        "data:image/png;base64,iVBO\nRw0K",
        "data:image/png;base64,",
        "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
        "data:image/png," + "iVBORw0KGgo",
        "data:image/png;base64",
        "data:;base64," + base64.b64encode(encoded("PNG")).decode(),
    ],
    ids=["bad-chars", "trailing", "newline", "empty", "text", "no-base64", "no-comma", "no-mime"],
)
def test_bad_data_urls_are_400(url):
    with pytest.raises(ImageInputError) as info:
        parse_data_url(url, ImageLimits(), PARAM)
    refused(info, 400)


def test_image_count_cap_names_messages():
    limits = ImageLimits(max_images_per_request=2)
    check_image_count(2, limits)
    with pytest.raises(ImageInputError) as info:
        check_image_count(3, limits)
    refused(info, 400, param="messages")


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)
    with pytest.raises(ValueError, match="allowed_domains"):
        ImageLimits(allowed_domains="example.com")  # type: ignore[arg-type]


# -- http(s) URLs: refused before any connection --------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/cat.png",
        "https://example.com/cat.png",
        "http://127.0.0.1/cat.png",
    ],
)
async def test_remote_urls_are_refused_by_default(url):
    with pytest.raises(ImageInputError) as info:
        await load_image_url(url, ImageLimits(), PARAM)
    assert "allowed domains" in refused(info, 400)


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/cat.png",
        "gopher://example.com/_GET",
        "javascript:alert(1)",
        "//example.com/cat.png",
        "example.com/cat.png",
        "http:///cat.png",
    ],
)
async def test_other_schemes_are_refused(url):
    limits = ImageLimits(allowed_domains=("example.com",))
    with pytest.raises(ImageInputError) as info:
        await load_image_url(url, limits, PARAM)
    refused(info, 400)


async def test_credentials_in_urls_are_refused():
    limits = ImageLimits(allowed_domains=("example.com",))
    with pytest.raises(ImageInputError) as info:
        await fetch_image("http://user:secret@example.com/cat.png", limits, PARAM)
    message = refused(info, 400)
    assert "credentials" in message and "secret" not in message


@pytest.mark.parametrize(
    "url, host",
    [
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
        ("http://[::1]/cat.png", "::1"),
        ("http://[::ffff:127.0.0.1]/cat.png", "::ffff:127.0.0.1"),
        ("http://[::ffff:169.254.169.254]/", "::ffff:169.254.169.254"),
        ("http://[2002:7f00:1::]/cat.png", "2002:7f00:1::"),
        ("http://[fe80::1]/cat.png", "fe80::1"),
        ("http://[fd00::1]/cat.png", "fd00::1"),
        ("http://2130706433/cat.png", "2130706433"),
        ("http://0x7f.1/cat.png", "0x7f.1"),
        ("http://127.1/cat.png", "127.1"),
        ("http://0177.0.0.1/cat.png", "0177.0.0.1"),
        ("http://0.0.0.0/cat.png", "0.0.0.0"),
        ("http://10.0.0.1/cat.png", "10.0.0.1"),
        ("http://172.16.5.4/cat.png", "172.16.5.4"),
        ("http://192.168.1.1/cat.png", "192.168.1.1"),
        ("http://100.64.0.1/cat.png", "100.64.0.1"),
        ("http://224.0.0.1/cat.png", "224.0.0.1"),
        ("http://240.0.0.1/cat.png", "240.0.0.1"),
        ("http://localhost/cat.png", "localhost"),
    ],
)
async def test_allowlisted_hosts_on_internal_addresses_are_refused(url, host):
    # Allowlisting the host itself shows that the resolved address is what refuses it.
    limits = ImageLimits(allowed_domains=(host,), fetch_timeout_s=2.0)
    with pytest.raises(ImageInputError) as info:
        await fetch_image(url, limits, PARAM)
    refused(info, 400)


@pytest.fixture
def fake_dns(monkeypatch):
    """Answers getaddrinfo for *.test names from a table; counts the lookups."""
    table: dict[str, list[str]] = {}
    lookups: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in table[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table, lookups


@pytest.mark.parametrize(
    "host, allowed",
    [
        ("img.example.test", True),
        ("example.test", True),
        ("evil-example.test", False),
        ("example.test.evil.test", False),
    ],
)
async def test_allowlist_matches_the_host_and_its_subdomains(host, allowed, fake_dns):
    table, _ = fake_dns
    table[host] = ["10.1.2.3"]
    limits = ImageLimits(allowed_domains=("example.test",))
    with pytest.raises(ImageInputError) as info:
        await fetch_image(f"http://{host.upper()}/cat.png", limits, PARAM)
    message = refused(info, 400)
    assert ("allowed domains" not in message) == allowed


async def test_any_internal_address_in_the_answer_refuses(fake_dns):
    table, _ = fake_dns
    table["mixed.test"] = ["93.184.215.14", "10.0.0.7"]
    limits = ImageLimits(allowed_domains=("mixed.test",))
    with pytest.raises(ImageInputError) as info:
        await fetch_image("http://mixed.test/cat.png", limits, PARAM)
    assert "private" in refused(info, 400)


# -- http(s) URLs against a real local server -----------------------------------------------

PNG = encoded("PNG", (32, 16))
BIG = 64 * 1024  # max_image_bytes for the byte-limit tests


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that hang up on a stalled or oversized answer are the point


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    release = threading.Event()
    hosts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            if value:
                self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.hosts.append(self.headers["Host"])
        if self.path == "/image.png":
            self.send(200, PNG, **{"Content-Type": "image/png"})
        elif self.path == "/redirect":
            self.send(302, Location="/image.png")
        elif self.path == "/missing":
            self.send(404, b"no such image")
        elif self.path == "/no-length":
            # Close-delimited body, twice the cap, with no Content-Length.
            self.close_connection = True
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PNG + b"\0" * 2 * BIG)
        elif self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(8):
                piece = b"\0" * (BIG // 4)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/declared-huge":
            # Says 1 GB and then stalls: refused from the header, without waiting.
            self.send_response(200)
            self.send_header("Content-Length", str(2**30))
            self.end_headers()
            self.wfile.write(PNG[:10])
            self.wfile.flush()
            self.release.wait(30)
        elif self.path == "/gzip":
            body = gzip.compress(b"\0" * 8 * 2**20, 1)  # inflates 1000x: must not be inflated
            self.send(200, body, **{"Content-Encoding": "gzip"})
        elif self.path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG[:20])
            self.wfile.flush()
            self.release.wait(30)


@pytest.fixture(scope="module")
def server():
    httpd = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    Handler.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


LOCAL = ImageLimits(allowed_domains=("127.0.0.1",), allow_private_networks=True)


async def test_local_fetch_returns_the_image_and_its_hash(server):
    image = await load_image_url(f"{server}/image.png", LOCAL, PARAM)
    assert (image.format, image.width, image.height) == ("PNG", 32, 16)
    assert image.data == PNG
    assert image.content_hash == hashlib.sha256(PNG).hexdigest()


async def test_allowlisted_loopback_is_refused_without_allow_private_networks(server):
    limits = ImageLimits(allowed_domains=("127.0.0.1", "localhost"))
    for url in (f"{server}/image.png", server.replace("127.0.0.1", "localhost") + "/image.png"):
        with pytest.raises(ImageInputError) as info:
            await fetch_image(url, limits, PARAM)
        assert "loopback" in refused(info, 400)


async def test_fetch_connects_to_the_checked_address(server, fake_dns):
    # images.test resolves once, to 127.0.0.1; the request goes there with the original Host.
    table, lookups = fake_dns
    table["images.test"] = ["127.0.0.1"]
    port = server.rsplit(":", 1)[1]
    limits = ImageLimits(allowed_domains=("images.test",), allow_private_networks=True)
    Handler.hosts.clear()
    image = await fetch_image(f"http://images.test:{port}/image.png", limits, PARAM)
    assert image.data == PNG
    assert lookups == ["images.test"]
    assert Handler.hosts == [f"images.test:{port}"]


@pytest.mark.parametrize("path, status_code", [("/redirect", 400), ("/missing", 400)])
async def test_redirects_and_errors_are_400(server, path, status_code):
    with pytest.raises(ImageInputError) as info:
        await fetch_image(server + path, LOCAL, PARAM)
    refused(info, status_code)


@pytest.mark.parametrize("path", ["/no-length", "/chunked", "/declared-huge"])
async def test_bodies_over_the_byte_limit_are_413(server, path):
    limits = ImageLimits(
        allowed_domains=("127.0.0.1",), allow_private_networks=True, max_image_bytes=BIG
    )
    start = time.perf_counter()
    with pytest.raises(ImageInputError) as info:
        await fetch_image(server + path, limits, PARAM)
    refused(info, 413)
    assert time.perf_counter() - start < 5


async def test_compressed_bodies_are_not_inflated(server):
    with pytest.raises(ImageInputError) as info:
        await fetch_image(f"{server}/gzip", LOCAL, PARAM)
    assert "not a valid" in refused(info, 400)


async def test_a_stalling_server_times_out_as_400(server):
    limits = ImageLimits(
        allowed_domains=("127.0.0.1",), allow_private_networks=True, fetch_timeout_s=0.5
    )
    start = time.perf_counter()
    with pytest.raises(ImageInputError) as info:
        await fetch_image(f"{server}/stall", limits, PARAM)
    assert "longer than" in refused(info, 400)
    assert time.perf_counter() - start < 1.5


def self_signed(tmp_path, name: str) -> tuple[str, str]:
    """A certificate for ``name`` (its own CA) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


@pytest.mark.parametrize("cert_name, ok", [("images.test", True), ("other.test", False)])
async def test_https_to_the_checked_address_verifies_the_original_name(
    cert_name, ok, tmp_path, fake_dns, monkeypatch
):
    # The connection goes to 127.0.0.1, yet the certificate is checked against images.test.
    cert_file, key_file = self_signed(tmp_path, cert_name)
    monkeypatch.setattr(certifi, "where", lambda: cert_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    table, _ = fake_dns
    table["images.test"] = ["127.0.0.1"]
    limits = ImageLimits(allowed_domains=("images.test",), allow_private_networks=True)
    url = f"https://images.test:{httpd.server_address[1]}/image.png"
    try:
        if ok:
            assert (await fetch_image(url, limits, PARAM)).data == PNG
        else:
            with pytest.raises(ImageInputError) as info:
                await fetch_image(url, limits, PARAM)
            assert "could not be fetched" in refused(info, 400)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
