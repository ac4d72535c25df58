"""Fetching image http(s) URLs (chat's image_url parts, a completions request's multi_modal_data), off unless
--allowed-media-domains lists hosts.

A fetch is one image from one listed host, under --media-fetch-timeout (the whole chain: redirects, connecting,
reading) and --media-fetch-max-bytes (counted while the body is read, after content decoding, so a gzip bomb
stops at the cap; a larger Content-Length is refused before the body is read). Against SSRF:

* hosts are matched exactly (no suffixes, no wildcards), and every redirect hop is checked again: a redirect to a
  host off the list, to another scheme, or from https down to http is refused, and there are at most 5 hops;
* the host's addresses are checked inside the connection (the connector's resolver), so what is checked is what is
  connected to (no DNS-rebinding gap between a check and the connect): a name resolving to any non-public address
  is refused, and a loopback, private (RFC 1918, ULA) or shared (100.64/10) address is taken only with
  --media-fetch-allow-private-addresses (an in-cluster image store); link-local (169.254/16, where the cloud
  metadata services live), multicast, unspecified and reserved addresses and the known metadata addresses are
  refused always. An IP literal in the URL gets the same checks;
* no proxy from the environment, no cookies kept, no credentials sent.

Every failure is an APIError 400 naming the image (messages[i].content[j], multi_modal_data.image[i]) with a
specific `code`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver
from yarl import URL

from shoal.engine.server.protocol import APIError

MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Content types an image may come as: image/*, or a generic binary type (object stores often serve those); the
# bytes are checked as an image after the fetch either way.
BINARY_TYPES = frozenset({"application/octet-stream", "binary/octet-stream"})
# Cloud metadata endpoints outside link-local space (AWS's IPv6 one, Alibaba's): refused even with private addresses
METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})


def address_refusal(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow_private: bool) -> str | None:
    """Why the engine will not connect to `ip` (None: it will)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if ip.is_link_local or ip in METADATA:
        return "a link-local or cloud metadata address"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return "not a unicast address"
    if ip.is_global or allow_private:
        return None
    kind = "a loopback" if ip.is_loopback else "a private"
    return f"{kind} address (--media-fetch-allow-private-addresses takes those)"


class AddressRefused(Exception):
    """The resolver's refusal of a host's address (not an OSError, so aiohttp passes it up as it is)."""


class _GuardedResolver(AbstractResolver):
    """The default resolver, refusing a host when any address it resolves to is refused."""

    def __init__(self, allow_private: bool):
        self._inner = aiohttp.DefaultResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        results = await self._inner.resolve(host, port, family)
        for r in results:
            why = address_refusal(ipaddress.ip_address(r["host"]), self._allow_private)
            if why is not None:
                raise AddressRefused(f"{host.rstrip('.')} resolves to {r['host']}, {why}")
        return results

    async def close(self) -> None:
        await self._inner.close()


def param_of(where: str) -> str:
    """The request field an image's place names: "messages" for messages[i].content[j], "multi_modal_data" for
    multi_modal_data.image[i] (a completions request's images)."""
    return where.partition("[")[0].partition(".")[0]


def _error(where: str, message: str, code: str) -> APIError:
    return APIError(f"{where}: {message}", 400, param=param_of(where), code=code)


class MediaFetcher:
    """The server's image fetcher (one per server: one connection pool)."""

    def __init__(self, domains: list[str] | None, max_bytes: int, timeout: float, allow_private: bool):
        self.domains = frozenset(domains or ())
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.allow_private = allow_private
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, config: Any) -> "MediaFetcher":
        return cls(config.allowed_media_domains, config.media_fetch_max_bytes, config.media_fetch_timeout,
                   config.media_fetch_allow_private_addresses)

    @property
    def enabled(self) -> bool:
        return bool(self.domains)

    def _check(self, where: str, url: URL, previous: URL | None) -> None:
        """400 unless `url` may be fetched (previous: the URL that redirected here)."""
        hop = f"a redirect from {previous.host} to {url}" if previous is not None else f"the image URL {url}"
        if url.scheme not in ("http", "https") or not url.host:
            raise _error(where, f"{hop} is not an http(s) URL with a host", "image_url_redirect_not_allowed"
                         if previous is not None else "image_url_invalid")
        if previous is not None and previous.scheme == "https" and url.scheme == "http":
            raise _error(where, f"{hop} goes from https down to http", "image_url_redirect_not_allowed")
        host = url.host.rstrip(".").lower()
        if host not in self.domains:
            code = "image_url_redirect_not_allowed" if previous is not None else "image_url_domain_not_allowed"
            raise _error(where, f"{hop}: the host {host} is not one this server fetches images from "
                                f"(--allowed-media-domains: {', '.join(sorted(self.domains))})", code)
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return  # a name: its addresses are checked as it is resolved (_GuardedResolver)
        why = address_refusal(ip, self.allow_private)
        if why is not None:
            raise _error(where, f"{hop}: {host} is {why}", "image_url_address_not_allowed")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(resolver=_GuardedResolver(self.allow_private), limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar(),
                headers={"User-Agent": "shoal-engine", "Accept": "image/*"})
        return self._session

    async def fetch(self, where: str, text: str) -> bytes:
        """The bytes at image URL `text` (400 naming `where` for anything that keeps it from being an image)."""
        if not self.enabled:
            raise _error(where, "fetching image URLs is off on this server: send the image inline as a base64 data "
                                "URL (data:image/png;base64,...), or start the server with --allowed-media-domains",
                         "image_url_fetch_disabled")
        try:
            url = URL(text)
        except ValueError as e:
            raise _error(where, f"the image URL is not a valid URL ({e})", "image_url_invalid") from None
        self._check(where, url, None)
        try:
            async with asyncio.timeout(self.timeout):
                return await self._follow(where, url)
        except TimeoutError:
            raise _error(where, f"fetching {url} took longer than {self.timeout:g}s (--media-fetch-timeout)",
                         "image_url_timeout") from None
        except AddressRefused as e:
            raise _error(where, f"fetching {url} is refused: {e}", "image_url_address_not_allowed") from None
        except aiohttp.ClientError as e:
            raise _error(where, f"fetching {url} failed: {type(e).__name__}: {e}", "image_url_fetch_failed") from None

    async def _follow(self, where: str, url: URL) -> bytes:
        session = self._client()
        for _ in range(MAX_REDIRECTS + 1):
            async with session.get(url, allow_redirects=False) as r:
                if r.status in REDIRECTS:
                    location = r.headers.get("Location")
                    if not location:
                        raise _error(where, f"{url} answered {r.status} without a Location",
                                     "image_url_upstream_status")
                    try:
                        target = url.join(URL(location))
                    except ValueError:
                        raise _error(where, f"{url} redirected to an invalid URL {location!r}",
                                     "image_url_redirect_not_allowed") from None
                    self._check(where, target, url)
                    url = target
                    continue
                if r.status != 200:
                    raise _error(where, f"{url} answered HTTP {r.status} {r.reason or ''}".rstrip(),
                                 "image_url_upstream_status")
                kind = r.content_type  # "application/octet-stream" when the header is absent
                if not kind.startswith("image/") and kind not in BINARY_TYPES:
                    raise _error(where, f"{url} answered content type {kind}, not an image", "image_url_not_an_image")
                return await self._read(where, url, r)
        raise _error(where, f"{url}: more than {MAX_REDIRECTS} redirects", "image_url_redirect_not_allowed")

    async def _read(self, where: str, url: URL, r: aiohttp.ClientResponse) -> bytes:
        too_large = f"the image at {url} is larger than {self.max_bytes} bytes (--media-fetch-max-bytes)"
        if r.content_length is not None and r.content_length > self.max_bytes:
            raise _error(where, too_large, "image_url_too_large")
        body = bytearray()
        async for chunk in r.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > self.max_bytes:  # stop reading: the connection is closed, not drained
                raise _error(where, too_large, "image_url_too_large")
        return bytes(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
