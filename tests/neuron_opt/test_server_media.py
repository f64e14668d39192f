"""Images in chat requests (server/media.py): real PNG, JPEG and WebP bytes encoded with PIL in data, file and http
URLs (a loopback HTTP server in a thread), each bad input a 400 naming the field, and a live server (tiny random
model, the official `openai` client) that refuses images for a text-only model, answers each limit with a 400, and
keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from helpers import live_server, one_thread_llm
from PIL import Image

from neuron_opt.errors import ConfigError
from neuron_opt.server.limits import MediaLimits, ServerLimits
from neuron_opt.server.media import ImagePrompt, load_chat_images

MODEL = "tiny"


def encoded(fmt: str, size: tuple[int, int] = (37, 21), color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    img.putpixel((0, 0), (0, 255, 0))
    img.save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def noise_png(width: int, height: int) -> bytes:
    """A PNG that does not compress: its bytes grow with its pixels."""
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), os.urandom(3 * width * height)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels and whose one IDAT holds a few bytes (never decodable)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


def image_msg(*urls: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


def load(messages: list[dict], limits: MediaLimits | None = None):
    return asyncio.run(load_chat_images(messages, limits or MediaLimits()))


def refused(messages: list[dict], limits: MediaLimits | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load(messages, limits)
    return e.value


# ---- data URLs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_data_urls_decode_to_rgb_images_in_hf_messages(fmt, media_type):
    png = Image.new("RGBA", (5, 9), (1, 2, 3, 4))
    buf = io.BytesIO()
    png.save(buf, "PNG")
    msgs = image_msg(data_url(encoded(fmt), media_type), data_url(buf.getvalue(), "image/png"))
    hf, images = load(msgs)
    assert [im.size for im in images] == [(37, 21), (5, 9)] and all(im.mode == "RGB" for im in images)
    assert hf == [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image", "image": images[0]},
                                               {"type": "image", "image": images[1]}]}]
    if fmt != "JPEG":  # lossless: the pixels are the encoder's
        assert images[0].getpixel((0, 0)) == (0, 255, 0) and images[0].getpixel((1, 1)) == (200, 30, 90)
    assert msgs[0]["content"][1]["type"] == "image_url"  # the request's messages are left as they came


FIELD = "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("url, words", [
    (data_url(encoded("JPEG"), "image/png"), "says image/png, but the image is image/jpeg"),
    (data_url(encoded("GIF"), "image/png"), "unsupported image format GIF"),
    (data_url(encoded("BMP"), "image/webp"), "unsupported image format BMP"),
    (data_url(encoded("GIF"), "image/gif"), "unsupported image format 'image/gif'"),
    (data_url(encoded("PNG")[:60], "image/png"), "corrupt or truncated PNG"),
    (data_url(encoded("JPEG", (300, 200))[:400], "image/jpeg"), "corrupt or truncated image header"),
    (data_url(encoded("JPEG", (300, 200))[:-300], "image/jpeg"), "corrupt or truncated JPEG image"),
    (data_url(b"\x00garbage" * 50, "image/png"), "not a readable PNG, JPEG or WebP image"),
    ("data:image/png;base64,***", "not valid base64"),
    ("data:image/png," + "abc", "must be base64"),
    ("ftp://example.com/a.png", "got scheme 'ftp'"),
    ("https://example.com/a.png", "not in this server's --allowed-media-domains (none)"),
    ("file:///etc/passwd", "file URLs are not allowed"),
])
def test_bad_images_are_refused_naming_the_field(url, words):
    e = refused(image_msg(url))
    assert e.param == FIELD and str(e).startswith(FIELD + ": ") and words in str(e), str(e)


def test_a_decompression_bomb_is_refused_from_its_header():
    limits = MediaLimits(max_image_pixels=4096 * 4096)
    for w, h in [(4097, 4096), (100_000, 100_000)]:  # past our bound; past PIL's own (2x Image.MAX_IMAGE_PIXELS)
        t = time.perf_counter()
        e = refused(image_msg(data_url(bomb_png(w, h), "image/png")), limits)
        assert e.param == FIELD and ("more than this server decodes" in str(e) or "more pixels" in str(e)), str(e)
        assert time.perf_counter() - t < 1.0  # never decoded
    e = refused([{"role": "user", "content": [{"type": "image", "image": Image.new("L", (70, 70))}]}],
                MediaLimits(max_image_pixels=4899))
    assert e.param == "messages[0].content[0].image" and "70x70 = 4900 pixels" in str(e)


def test_count_bytes_and_detail_limits():
    url = data_url(encoded("PNG"), "image/png")
    e = refused(image_msg(url, url, url), MediaLimits(max_images=2))
    assert e.param == "messages" and "at most 2 images" in str(e) and "got 3" in str(e)
    e = refused(image_msg(url), MediaLimits(max_images=0))
    assert "at most 0 images" in str(e)
    big = encoded("PNG", (300, 300))
    e = refused(image_msg(data_url(big, "image/png")), MediaLimits(max_image_bytes=len(big) - 1))
    assert e.param == FIELD and "--max-image-bytes" in str(e)
    assert load(image_msg(data_url(big, "image/png")), MediaLimits(max_image_bytes=len(big)))[1][0].size == (300, 300)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "high"}}]}]
    e = refused(msgs)
    assert e.param == "messages[0].content[0].image_url.detail" and "only 'auto'" in str(e)


def test_media_limits_and_the_limit_mm_per_prompt_flag():
    assert MediaLimits.parse_limit_mm_per_prompt('{"image": 3}') == 3
    assert MediaLimits.parse_limit_mm_per_prompt("{}") == MediaLimits.max_images
    for bad, words in [('{"video": 1}', "only 'image'"), ("[1]", "JSON object"), ('{"image": "2"}', "JSON object"),
                       ("image=2", "JSON object")]:
        with pytest.raises(ConfigError, match=words):
            MediaLimits.parse_limit_mm_per_prompt(bad)
    for kw in [{"max_image_bytes": 0}, {"max_images": -1}, {"media_fetch_timeout": float("nan")},
               {"allowed_media_domains": ("http://x.org",)}, {"allowed_local_media_path": Path("/nonexistent-dir")}]:
        with pytest.raises(ConfigError) as e:
            MediaLimits(**kw)
        assert e.value.param == next(iter(kw))


# ---- file URLs -----------------------------------------------------------------------------------------------


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    root, other = tmp_path / "media", tmp_path / "private"
    root.mkdir()
    other.mkdir()
    (root / "cat.webp").write_bytes(encoded("WEBP", (8, 6)))
    (other / "secret.png").write_bytes(encoded("PNG"))
    os.symlink(other / "secret.png", root / "link.png")  # inside the directory, pointing out of it
    os.symlink(root / "cat.webp", other / "in.webp")  # outside, pointing in: the file read is inside
    (root / "sub").mkdir()
    os.mkfifo(root / "fifo.png")  # opening it for reading would wait for a writer
    limits = MediaLimits(allowed_local_media_path=root)
    assert load(image_msg((root / "cat.webp").as_uri()), limits)[1][0].size == (8, 6)
    assert load(image_msg(f"file://localhost{root}/sub/../cat.webp"), limits)[1][0].size == (8, 6)
    assert load(image_msg((other / "in.webp").as_uri()), limits)[1][0].size == (8, 6)
    for url, words in [((other / "secret.png").as_uri(), "not under"), ((root / "link.png").as_uri(), "not under"),
                       (f"file://{root}/../private/secret.png", "not under"),
                       ((root / "missing.png").as_uri(), "no such file"), ((root / "sub").as_uri(), "not a regular"),
                       ((root / "fifo.png").as_uri(), "not a regular"),
                       ("file://other-host/x.png", "no host"), ("file:cat.webp", "not under")]:
        e = refused(image_msg(url), limits)
        assert e.param == FIELD and words in str(e), (url, str(e))


# ---- http URLs (a loopback server) ---------------------------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = encoded("JPEG", (40, 30))
        if self.path == "/slow.jpg":  # the headers, then a body that never arrives in time
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:10])
            self.wfile.flush()
            time.sleep(3)
            return
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?to=", 1)[1])
            self.end_headers()
            return
        if self.path == "/missing.jpg":
            self.send_error(404)
            return
        if self.path == "/big-chunked.jpg":  # no Content-Length: refused while it streams
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\xff" * 200_000)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/jpeg")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_urls_only_from_allowed_hosts(image_host):
    port = image_host.rsplit(":", 1)[1]
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), media_fetch_timeout=1.0)
    assert load(image_msg(image_host + "/cat.jpg"), limits)[1][0].size == (40, 30)
    assert load(image_msg(f"{image_host}/redirect?to=/cat.jpg"), limits)[1][0].size == (40, 30)
    t = time.perf_counter()
    small = MediaLimits(allowed_media_domains=("127.0.0.1",), media_fetch_timeout=1.0, max_image_bytes=500)
    for url, words, lim in [
        (f"http://localhost:{port}/cat.jpg", "host 'localhost' is not in this server's --allowed-media-domains "
                                             "(127.0.0.1)", limits),
        (f"{image_host}/redirect?to=http://localhost:{port}/cat.jpg", "host 'localhost' is not", limits),
        (f"{image_host}/missing.jpg", "answered HTTP 404", limits),
        (f"{image_host}/slow.jpg", "longer than 1 s (--media-fetch-timeout)", limits),
        (f"{image_host}/big-chunked.jpg", "--max-image-bytes", small),  # refused while it streams
        (f"{image_host}/cat.jpg", "--max-image-bytes", small),  # refused from its Content-Length
        ("http://127.0.0.1:9/cat.jpg", "cannot fetch the image (ConnectError)", limits),  # (a closed port)
    ]:
        e = refused(image_msg(url), lim)
        assert e.param == FIELD and words in str(e), (url, str(e))
    assert time.perf_counter() - t < 5  # the slow host cost its timeout, not its 3 s


def test_a_fetch_does_not_block_the_event_loop(image_host):
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), media_fetch_timeout=1.0)

    async def both() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(ConfigError, match="longer than 1 s"):
            await load_chat_images(image_msg(f"{image_host}/slow.jpg"), limits)
        ticker.cancel()
        return ticks

    assert asyncio.run(both()) > 30  # the loop ran on while the download waited


# ---- the live server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with one_thread_llm(tiny_dir("smollm-tok"), 2, 256) as llm:
        yield llm


@pytest.fixture(scope="module")
def text_server(llm):
    with live_server(llm, max_num_seqs=2, model=MODEL) as (url, _):
        yield url


PNG_URL = data_url(encoded("PNG"), "image/png")


def image_content(*urls: str) -> list[dict]:
    return [{"type": "text", "text": "What is this?"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]


def test_a_text_only_model_refuses_images_and_serves_on(text_server, llm):
    client = openai.OpenAI(base_url=text_server + "/v1", api_key="x", max_retries=0)
    card = client.models.list().data[0]
    assert card.model_extra["input_modalities"] == ["text"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": image_content(PNG_URL)}])
    assert e.value.body["param"] == "messages[0].content[1]"
    assert e.value.body["message"] == ("messages[0].content[1]: model 'tiny' does not accept images (it takes text)")
    # the other routes, in their own field names
    r = httpx.post(text_server + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG_URL.split(",")[1]}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.1: model 'tiny' does "
                                                                            "not accept images"), r.text
    r = httpx.post(text_server + "/v1/responses", json={"model": MODEL, "instructions": "Be brief.", "input": [{
        "role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image",
                                                                           "image_url": PNG_URL}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.1", r.text
    out = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert out.usage.completion_tokens == 3
    with pytest.raises(ConfigError) as ce:  # LLM.chat: the same refusal
        llm.chat([{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (4, 4))},
                                               {"type": "text", "text": "hi"}]}])
    assert ce.value.param == "messages[0].content[0]" and "does not accept images" in str(ce.value)


class Renderer:
    """The server's image hook, as an image-capable model's renderer is called: records the images it gets and
    renders the text alone (this tiny model has no vision: the limits are what this test is about)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.seen: list = []

    def __call__(self, messages, tools, template_kwargs) -> ImagePrompt:
        images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]
        self.seen.append([im.size for im in images])
        text = [{**m, "content": "".join(p["text"] for p in m["content"] if p["type"] == "text")}
                if isinstance(m["content"], list) else m for m in messages]
        return ImagePrompt(self.llm.encode_chat(text, tools, template_kwargs), {})


@pytest.fixture(scope="module")
def image_server(llm, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(encoded("PNG", (12, 7)))
    renderer = Renderer(llm)
    limits = ServerLimits(media=MediaLimits(max_images=2, max_image_bytes=50_000, max_image_pixels=1000 * 1000,
                                            allowed_local_media_path=root, allowed_media_domains=("127.0.0.1",)))
    with live_server(llm, max_num_seqs=2, model=MODEL, limits=limits, encode_image_chat=renderer) as (url, _):
        yield url, renderer, root


def test_an_image_model_answers_each_limit_with_a_400_and_serves_on(image_server, tmp_path):
    url, renderer, root = image_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]
    cases = [
        ([PNG_URL] * 3, "messages", "at most 2 images per request"),
        ([data_url(noise_png(200, 200), "image/png")], FIELD, "--max-image-bytes"),
        ([data_url(bomb_png(1001, 1000), "image/png")], FIELD, "more than this server decodes (1000000"),
        ([data_url(encoded("PNG")[:70], "image/png")], FIELD, "corrupt or truncated PNG"),
        ([data_url(encoded("GIF"), "image/png")], FIELD, "unsupported image format GIF"),
        (["https://example.com/cat.png"], FIELD, "'example.com' is not in this server's --allowed-media-domains"),
        ([(tmp_path / "x.png").as_uri()], FIELD, "not under this server's --allowed-local-media-path"),
    ]
    for urls, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": image_content(*urls)}])
        assert e.value.status_code == 400 and e.value.body["param"] == param and words in e.value.body["message"], \
            e.value.body
    assert renderer.seen == []  # nothing refused reached the model
    out = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": image_content(PNG_URL, (root / "cat.png").as_uri())}])
    assert out.usage.completion_tokens == 3 and renderer.seen == [[(37, 21), (12, 7)]]
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/jpeg", "data": PNG_URL.split(",")[1]}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.1: the data URL "
                                                                            "says image/jpeg"), r.text
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [{
        "role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image",
                                                                           "image_url": PNG_URL}]}]})
    assert r.status_code == 200 and renderer.seen[-1] == [(37, 21)], r.text


def test_images_belong_to_user_messages():
    from neuron_opt.server.protocol import ChatCompletionRequest, ProtocolError

    part = {"type": "image_url", "image_url": {"url": PNG_URL}}
    for role in ("system", "assistant"):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": [part]}]})
        with pytest.raises(ProtocolError) as e:
            req.message_dicts()
        assert e.value.param == "messages[0].content[0]" and "images belong to user messages" in str(e.value)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.message_dicts() == [{"role": "user", "content": "ab"}]  # text parts alone: one string, as before
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "image_url": {"url": PNG_URL}}]}]})
    with pytest.raises(ProtocolError, match=r"messages\[0\].content\[0\]: a content part is"):
        req.message_dicts()


def test_serve_flags_set_the_media_limits(tmp_path):
    from neuron_opt.cli import build_parser
    from neuron_opt.commands.serve_engine import server_limits

    def limits(*flags: str) -> MediaLimits:
        return server_limits(build_parser().parse_args(["serve", "--model", "default", *flags])).media

    assert limits() == MediaLimits()
    assert limits("--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "Upload.Wikimedia.org.",
                  "127.0.0.1", "--allowed-local-media-path", str(tmp_path), "--max-image-bytes", "1000",
                  "--max-image-pixels", "4000", "--media-fetch-timeout", "0.5") == MediaLimits(
        2, 1000, 4000, ("upload.wikimedia.org", "127.0.0.1"), tmp_path, 0.5)
    for flags, message in [(["--limit-mm-per-prompt", '{"audio": 1}'], "--limit-mm-per-prompt: only 'image'"),
                           (["--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt: must be >= 0"),
                           (["--max-image-pixels", "0"], "--max-image-pixels: must be >= 1"),
                           (["--allowed-media-domains", "https://x.org"], "--allowed-media-domains: 'https://x.org'"),
                           (["--allowed-local-media-path", str(tmp_path / "no")], "--allowed-local-media-path: "),
                           (["--media-fetch-timeout", "inf"], "--media-fetch-timeout: must be > 0")]:
        with pytest.raises(ConfigError) as e:
            limits(*flags)
        assert str(e.value).startswith(message), str(e.value)
