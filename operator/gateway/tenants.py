"""Who is asking: the tenant a request is admitted for (fairness, admission.py), and the keys that say so.

Three ways, one per deployment:
* `--tenant-keys DIR`: a directory of files, one per tenant, each holding that tenant's API keys one per line —
  what a Kubernetes Secret mounted as a volume looks like (`kubectl create secret generic tenants
  --from-literal=team-a=sk-a1 --from-file=team-b.batch=team-b-keys.txt`). A request's key (`Authorization:
  Bearer` or `X-API-Key`, as the engines take it) names its tenant; any other request gets 401. The directory is
  re-read when it changes (a rotated Secret), at most every `reload_interval` seconds, without a restart.
* `--tenant-header NAME`: an authenticating proxy in front of the gateway sets this header (e.g. the inference
  extension's `x-gateway-inference-fairness-id`); the gateway believes it only from the peers `--trusted-proxies`
  names (CIDRs) and ignores it from anyone else. The shared gateway answers 401 to a request without a believed
  header; a per-service gateway counts it as the one default tenant.
* neither: everyone is one tenant ("default"), so admission is by priority and arrival only.

A tenant belongs to a Kubernetes namespace: its name is `<namespace>` or `<namespace>.<anything>` (namespace names
hold no dot), and the shared gateway lets it use its namespace's models and those of namespaces that grant it
(fleet.py). The one tenant of a gateway that authenticates nobody belongs to no namespace.

Keys are compared as SHA-256 digests looked up in a dict: no key is ever compared character by character.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import time
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger("shoal.gateway.tenants")

DEFAULT_TENANT = "default"
MAX_TENANT_CHARS = 128


def presented_key(request: web.Request) -> str:
    """The engine's rule (engine/server/app.py): `Authorization: Bearer <key>` or `X-API-Key: <key>`."""
    given = request.headers.get("Authorization", "")
    return given[7:].strip() if given[:7].lower() == "bearer " else request.headers.get("X-API-Key", "").strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_dir(path: str) -> dict[str, list[str]]:
    """File name -> the non-empty lines of the file, for the regular files of `path` (a mounted Secret's
    `..data` entries and other dot-files are Kubernetes' bookkeeping, skipped)."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(full):
            continue
        with open(full, encoding="utf-8") as f:
            out[name] = [line.strip() for line in f if line.strip()]
    return out


def _signature(path: str) -> tuple:
    """What changes when the directory's keys do: its own mtime (Kubernetes swaps the `..data` symlink of a mounted
    Secret on update) and each file's (an edited file in a plain directory)."""
    entries = []
    for name in sorted(os.listdir(path)):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        entries.append((name, st.st_mtime_ns, st.st_size))
    return os.stat(path).st_mtime_ns, tuple(entries)


class KeyDirectory:
    """A mounted Secret read as {file name: lines}, re-read when it changes."""

    def __init__(self, path: str, reload_interval: float = 5.0):
        self.path = path
        self.reload_interval = reload_interval
        self._checked = 0.0
        self._signature: tuple | None = None
        self.entries: dict[str, list[str]] = {}
        self.reload(strict=True)

    def reload(self, strict: bool = False) -> bool:
        """Read the directory when it changed; True when it did. A read error keeps the last entries (strict: at
        start-up, where a missing or unreadable directory is the operator's mistake to report)."""
        try:
            signature = _signature(self.path)
            if signature == self._signature:
                return False
            self.entries = read_key_dir(self.path)
            self._signature = signature
            return True
        except OSError as e:
            if strict:
                raise ValueError(f"cannot read {self.path}: {e.strerror}") from None
            log.warning("cannot re-read %s (keeping the keys read before): %s", self.path, e)
            return False

    def maybe_reload(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.reload_interval:
            return False
        self._checked = now
        return self.reload()


class TenantKeys(KeyDirectory):
    """API key -> tenant, from a directory of one file per tenant."""

    def __init__(self, path: str, reload_interval: float = 5.0):
        self._by_digest: dict[bytes, str] = {}
        super().__init__(path, reload_interval)
        if not self._by_digest:
            raise ValueError(f"{path} holds no tenant keys (one file per tenant, one key per line)")

    def reload(self, strict: bool = False) -> bool:
        changed = super().reload(strict)
        if changed:
            by_digest: dict[bytes, str] = {}
            for tenant, keys in self.entries.items():
                for key in keys:
                    if by_digest.setdefault(_digest(key), tenant) != tenant:
                        log.warning("an API key in %s is listed for tenants %s and %s: it counts as %s", self.path,
                                    by_digest[_digest(key)], tenant, by_digest[_digest(key)])
            self._by_digest = by_digest
        return changed

    def tenant_of(self, key: str) -> str | None:
        self.maybe_reload()
        return self._by_digest.get(_digest(key)) if key else None

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self._by_digest.values()))


class EngineKeys(KeyDirectory):
    """The engines' API keys the shared gateway sends on, one file per InferenceService named
    `<namespace>.<name>`: the newest key first, during a rotation the previous one on the next line (the gateway
    retries a 401 once with it, so engines that have not re-read their Secret yet keep answering)."""

    def keys_for(self, namespace: str, name: str) -> list[str]:
        self.maybe_reload()
        return self.entries.get(f"{namespace}.{name}") or []

    def key_for(self, namespace: str, name: str) -> str | None:
        lines = self.keys_for(namespace, name)
        return lines[0] if lines else None


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant (fairness, quotas) and its namespace (what it may use; None: a gateway that
    authenticates nobody, whose one tenant may use everything it serves)."""

    tenant: str
    namespace: str | None


def namespace_of(tenant: str) -> str:
    return tenant.split(".", 1)[0]


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def parse_networks(text: str) -> tuple[Network, ...]:
    """`--trusted-proxies`: comma-separated CIDRs (or addresses)."""
    try:
        return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())
    except ValueError as e:
        raise ValueError(f"--trusted-proxies: {e}") from None


class Tenancy:
    """The caller of a request, or None when it must be refused (401)."""

    def __init__(self, keys: TenantKeys | None = None, header: str | None = None,
                 trusted: tuple[Network, ...] = LOOPBACK, header_required: bool = False):
        self.keys = keys
        self.header = header
        self.trusted = trusted
        self.header_required = header_required  # the shared gateway: the header is how callers authenticate

    @property
    def authenticates(self) -> bool:
        return self.keys is not None or (self.header is not None and self.header_required)

    def _trusted(self, request: web.Request) -> bool:
        try:
            peer = ipaddress.ip_address(request.remote or "")
        except ValueError:
            return False
        return any(peer in net for net in self.trusted)

    def identify(self, request: web.Request) -> Caller | None:
        if self.keys is not None:
            tenant = self.keys.tenant_of(presented_key(request))
            return Caller(tenant, namespace_of(tenant)) if tenant else None
        if self.header:
            value = request.headers.get(self.header, "").strip()[:MAX_TENANT_CHARS]
            if value and self._trusted(request):
                return Caller(value, namespace_of(value) if self.header_required else None)
            return None if self.header_required else Caller(DEFAULT_TENANT, None)
        return Caller(DEFAULT_TENANT, None)
