"""image_url http(s) URLs through the real `shoal-engine serve` and the openai client: fetched only from the hosts
--allowed-media-domains lists, with a byte cap, a time cap and SSRF checks (engine/server/media.py), and the
per-image pixel budget (--max-image-pixels), for chat's image_url parts and a completions request's
multi_modal_data alike. Each refusal is a 400 with its code naming the content part (or multi_modal_data.image[i]),
and leaves nothing running and no KV block held.

The images are served by an aiohttp app in a thread on 127.0.0.1, listed as `localhost`: a loopback address, which
the fetcher refuses unless --media-fetch-allow-private-addresses is given, so the server here opts into it
explicitly (test_loopback_is_refused_without_the_opt_in shows the refusal without it)."""

from __future__ import annotations

import asyncio
import struct
import threading
import zlib

import openai
import pytest
from aiohttp import web
from openai import OpenAI

from imagekit import complete, data_url, encode, image_part, make_image, rendered
from .conftest import metric
from .test_openai_server import wait_idle

pytest.importorskip("PIL")

MAX = 6
QUESTION = "What is in the picture?"
CAP = 64 * 1024  # --media-fetch-max-bytes
PNG = encode(make_image(31))  # 60x40: under the budget
BIG = encode(make_image(32, 100, 100))  # 10000 pixels: over --max-image-pixels 5000


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixels: only a check of the header can tell its size."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = b"\x00" * 8
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)


class ImageHost:
    """The image server, on its own event loop in a thread."""

    def __init__(self):
        self.stall = None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.stall = asyncio.Event()  # never set: a handler that waits on it never answers
        app = web.Application()
        r = app.router
        image = lambda body, kind="image/png": lambda req: web.Response(body=body, content_type=kind)  # noqa: E731
        r.add_get("/img.png", image(PNG))
        r.add_get("/big.png", image(BIG))
        r.add_get("/header-only.png", image(png_header(10000, 5000)))
        r.add_get("/page.html", image(b"<html></html>", "text/html"))
        r.add_get("/large", image(b"\x00" * (CAP + 1), "application/octet-stream"))
        r.add_get("/missing.png", lambda req: web.Response(status=404))
        r.add_get("/same-host", lambda req: web.HTTPFound("/img.png"))
        r.add_get("/off-list", lambda req: web.HTTPFound(f"http://127.0.0.1:{self.port}/img.png"))
        r.add_get("/chunked", self._chunked)
        r.add_get("/slow", self._slow)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _chunked(self, request):  # no Content-Length: the cap must hold while reading
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        for _ in range(CAP // 4096 + 2):
            await resp.write(b"\x00" * 4096)
        await resp.write_eof()
        return resp

    async def _slow(self, request):  # headers and a little of the body, then nothing
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        await resp.prepare(request)
        await resp.write(PNG[:100])
        await self.stall.wait()
        return resp

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(scope="module")
def host():
    return ImageHost()


@pytest.fixture(scope="module")
def server(start_server, llava_model):
    return start_server(llava_model, "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "4",
                        "--allowed-media-domains", "localhost", "--media-fetch-allow-private-addresses",
                        "--media-fetch-max-bytes", str(CAP), "--media-fetch-timeout", "1",
                        "--max-image-pixels", "5000")


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(client, content):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX, temperature=0, extra_body={"ignore_eos": True})


def test_a_fetched_image_answers_as_its_data_url(client, host):
    want = chat(client, [{"type": "text", "text": QUESTION}, image_part(PNG)]).choices[0].message.content
    for path in ("/img.png", "/same-host"):  # a redirect to the same listed host is followed
        got = chat(client, [{"type": "text", "text": QUESTION}, url_part(host.url(path))])
        assert got.choices[0].message.content == want, path


def ask(client, route: str, url: str):
    """The question about the image at `url`, through chat or as a completion of chat's rendered prompt."""
    if route == "chat":
        return chat(client, [{"type": "text", "text": QUESTION}, url_part(url)])
    return complete(client, rendered(f"{QUESTION}\n<image>"), [{"url": url}], MAX)


def test_a_fetched_image_on_completions_answers_as_chat(client, host):
    want = chat(client, [{"type": "text", "text": QUESTION}, image_part(PNG)]).choices[0].message.content
    assert ask(client, "completions", data_url(PNG)).choices[0].text == want
    assert ask(client, "completions", host.url("/same-host")).choices[0].text == want


@pytest.mark.parametrize("route, where", [("chat", "messages[0].content[1]"),
                                          ("completions", "multi_modal_data.image[0]")])
@pytest.mark.parametrize("path, code, message", [
    ("/img.png?host=other", "image_url_domain_not_allowed", "not one this server fetches images from"),
    ("/off-list", "image_url_redirect_not_allowed", "127.0.0.1 is not one this server fetches"),
    ("/large", "image_url_too_large", "larger than 65536 bytes"),
    ("/chunked", "image_url_too_large", "larger than 65536 bytes"),
    ("/slow", "image_url_timeout", "longer than 1s"),
    ("/missing.png", "image_url_upstream_status", "HTTP 404"),
    ("/page.html", "image_url_not_an_image", "text/html, not an image"),
    ("/big.png", "image_too_many_pixels", "100x100 = 10000 pixels, more than the budget of 5000"),
    ("/header-only.png", "image_too_many_pixels", "10000x5000"),  # refused from the header, before decoding
])
def test_a_refused_fetch_is_a_400_naming_the_part(client, server, host, route, where, path, code, message):
    url = host.url(path.split("?")[0], "127.0.0.1" if "host=other" in path else "localhost")
    with pytest.raises(openai.BadRequestError, match=message) as e:
        ask(client, route, url)
    assert e.value.code == code
    assert f"- {where}: " in e.value.message and e.value.param == where.partition("[")[0].partition(".")[0]
    m = wait_idle(server)
    assert metric(m, "shoal:num_requests_running") + metric(m, "shoal:num_requests_waiting") == 0
    assert metric(m, "shoal:kv_cache_usage_perc") == 0


def test_the_pixel_budget_holds_for_data_urls(client, server):
    with pytest.raises(openai.BadRequestError, match="more than the budget of 5000 pixels") as e:
        chat(client, [{"type": "text", "text": QUESTION}, image_part(PNG), image_part(BIG)])
    assert e.value.code == "image_too_many_pixels" and "messages[0].content[2]" in e.value.message
    assert chat(client, [{"type": "text", "text": QUESTION}, image_part(PNG)]).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="more than the budget of 5000 pixels") as e:
        complete(client, "<image><image>", [data_url(PNG), data_url(BIG)], MAX)
    assert e.value.code == "image_too_many_pixels" and "multi_modal_data.image[1]" in e.value.message


def test_loopback_is_refused_without_the_opt_in(host):
    from shoal.engine.server.media import MediaFetcher
    from shoal.engine.server.protocol import APIError

    async def attempt(url, allow_private):
        fetcher = MediaFetcher(["localhost", "127.0.0.1"], CAP, 5.0, allow_private)
        try:
            return await fetcher.fetch("messages[0].content[0]", url)
        finally:
            await fetcher.close()

    for url in (host.url("/img.png"), host.url("/img.png", "127.0.0.1")):  # a name and an IP literal
        with pytest.raises(APIError, match="loopback address") as e:
            asyncio.run(attempt(url, False))
        assert e.value.code == "image_url_address_not_allowed"
        assert asyncio.run(attempt(url, True)) == PNG


@pytest.mark.parametrize("address, allow_private, refused", [
    ("169.254.169.254", True, True), ("fd00:ec2::254", True, True), ("::ffff:127.0.0.1", False, True),
    ("10.1.2.3", False, True), ("10.1.2.3", True, False), ("0.0.0.0", True, True), ("224.0.0.1", True, True),
    ("93.184.216.34", False, False), ("2606:4700::1111", False, False),
])
def test_address_policy(address, allow_private, refused):
    import ipaddress

    from shoal.engine.server.media import address_refusal

    assert (address_refusal(ipaddress.ip_address(address), allow_private) is not None) == refused
