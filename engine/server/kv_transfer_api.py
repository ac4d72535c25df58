"""The HTTP side of prefill/decode disaggregation (core/kv_transfer.py): a producer's pull route, the
kv_transfer_params it answers a prefill with, and a consumer's pull of a prompt's blocks before it schedules the
request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.engine.core.kv_transfer import PULL_PATH, TransferError, decode_blocks, encode_blocks
from shoal.engine.kv_hash import hash_chain
from shoal.engine.server.common import ServerState, get_state, read_json, require_loaded
from shoal.engine.server.protocol import APIError

log = logging.getLogger(__name__)
_SESSION_KEY = "kv_transfer_session"


class TransferParams(BaseModel):
    """A request's kv_transfer_params (vLLM's field): what a router asks of this engine."""

    model_config = ConfigDict(extra="ignore")

    do_remote_decode: bool = False  # this engine prefills; another decodes
    do_remote_prefill: bool = False  # another engine prefilled: pull the prompt's KV from it
    remote_host: str | None = Field(default=None, min_length=1, max_length=253)
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_engine_id: str | None = None
    remote_request_id: str | None = Field(default=None, max_length=64)  # the producer's hold on the prompt's blocks


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: dict[str, Any]
    block_hashes: list[int | str] = Field(max_length=1 << 16)
    hold_id: str | None = Field(default=None, max_length=64)  # let go of this hold once the blocks are copied


def parse(raw: dict | None) -> TransferParams | None:
    if not raw:
        return None
    try:
        params = TransferParams.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise APIError(f"kv_transfer_params.{'.'.join(map(str, err['loc']))}: {err['msg']}", 400,
                       param="kv_transfer_params") from None
    if params.do_remote_decode and params.do_remote_prefill:
        raise APIError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other", 400,
                       param="kv_transfer_params")
    if params.do_remote_prefill and (params.remote_host is None or params.remote_port is None):
        raise APIError("kv_transfer_params.do_remote_prefill needs remote_host and remote_port (the producer's answer "
                       "to the prefill request carries them)", 400, param="kv_transfer_params")
    return params


def _role(state: ServerState, produces: bool) -> None:
    cfg = state.engine.config.kv_transfer_config
    ok = cfg is not None and (cfg.produces if produces else cfg.consumes)
    if not ok:
        role, flag = ("producer", "kv_producer") if produces else ("consumer", "kv_consumer")
        what = "do_remote_decode" if produces else "do_remote_prefill"
        raise APIError(f"kv_transfer_params.{what}: this engine is not a KV {role} (start it with --kv-transfer-config "
                       f"'{{\"kv_connector\": \"ShoalConnector\", \"kv_role\": \"{flag}\"}}')", 400,
                       param="kv_transfer_params")


def check(state: ServerState, params: TransferParams | None, stream: bool) -> None:
    """Refuse, before anything runs, kv_transfer_params this engine cannot honour."""
    if params is None:
        return
    if params.do_remote_decode:
        _role(state, produces=True)
        if stream:
            raise APIError("kv_transfer_params.do_remote_decode: a prefill request is answered whole (stream: false), "
                           "its answer carries the kv_transfer_params for the decode", 400, param="kv_transfer_params")
    if params.do_remote_prefill:
        _role(state, produces=False)


async def producer_answer(request: web.Request, state: ServerState, jobs: list) -> dict:
    """The kv_transfer_params a producer returns with a finished prefill: where a consumer pulls the prompt's KV
    from (the host and port the router reached this engine at: its pod address), and the hold that keeps the
    prompt's blocks for that pull (`remote_request_id`; the first prompt's, as a prefill carries one)."""
    block_size = state.engine.config.block_size
    hashes = list(hash_chain(jobs[0].prompt_ids[:len(jobs[0].prompt_ids) - 1], block_size)) if jobs else []
    engine_id, hold_id, tp = await state.engine.run_in_engine(lambda e: (
        e.kv_transfer.engine_id, e.kv_transfer.hold(hashes) if hashes else None, e.config.tensor_parallel_size))
    url = request.url
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": hold_id, "remote_host": url.host, "remote_port": url.port,
            "remote_block_size": block_size, "tp_size": tp}


async def pull_before(request: web.Request, state: ServerState, params: TransferParams | None, jobs: list,
                      lora: str | None) -> None:
    """A consumer: bring each job's prompt blocks from the producer named in `params` into this engine's first
    offload tier, so its prefill starts from them. Never fails the request: what cannot be pulled is computed."""
    if params is None or not params.do_remote_prefill:
        return
    metrics = state.metrics
    for job in jobs:
        if job.images:  # blocks holding images are hashed with them, and the tiers only hold text blocks
            metrics.kv_transfer_fallback("images")
            continue
        if lora is not None:  # adapter ids (a chain's root) are this engine's own: another engine's differ
            metrics.kv_transfer_fallback("lora")
            continue
        started = time.monotonic()
        try:
            got, missed = await _pull(request, state, params, job.prompt_ids)
        except TransferError as e:
            log.warning("KV pull from %s:%s failed (%s: %s); prefilling locally", params.remote_host,
                        params.remote_port, e.reason, e)
            metrics.kv_transfer_fallback(e.reason)
            continue
        metrics.kv_transfer_pulled(got, missed, time.monotonic() - started)


async def _pull(request: web.Request, state: ServerState, params: TransferParams, prompt: list[int]):
    cfg = state.engine.config
    hashes = list(hash_chain(prompt[:len(prompt) - 1], cfg.block_size))  # the last token is always computed
    if not hashes:
        return 0, 0
    held, fingerprint, nbytes = await state.engine.run_in_engine(
        lambda e: (e.kv_transfer.held(hashes), e.kv_transfer.fingerprint, e.kv_transfer.block_nbytes))
    want = hashes[held:]
    if not want and params.remote_request_id is None:
        return 0, 0
    url = f"http://{_host(params.remote_host)}:{params.remote_port}{PULL_PATH}"
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")}
    limit = 4096 + len(want) * (nbytes + 32)
    try:
        async with _session(request).post(
                url, json={"fingerprint": fingerprint, "block_hashes": [str(h) for h in want],
                           "hold_id": params.remote_request_id}, headers=headers,
                timeout=aiohttp.ClientTimeout(total=cfg.kv_transfer_config.pull_timeout)) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                raise TransferError("incompatible" if resp.status == 409 else "refused",
                                    f"the producer answered {resp.status}: {text}")
            if (resp.content_length or 0) > limit:
                raise TransferError("malformed", f"the producer's answer is {resp.content_length} bytes, more than "
                                                 f"{len(want)} block(s) can be")
            parts, size = [], 0
            async for part in resp.content.iter_chunked(1 << 20):  # read() returns what has arrived so far
                size += len(part)
                if size > limit:
                    raise TransferError("malformed", f"the producer's answer runs past {limit} bytes, more than "
                                                     f"{len(want)} block(s) can be")
                parts.append(part)
            payload = b"".join(parts)
    except asyncio.TimeoutError:
        raise TransferError("timeout", f"no answer within {cfg.kv_transfer_config.pull_timeout:g} s") from None
    except aiohttp.ClientError as e:
        raise TransferError("unreachable", f"{type(e).__name__}: {e}") from None
    blobs = decode_blocks(payload, want, nbytes)
    if blobs:
        await state.engine.run_in_engine(lambda e: e.kv_transfer.import_blocks(want[:len(blobs)], blobs))
    return len(blobs), len(want) - len(blobs)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _session(request: web.Request) -> aiohttp.ClientSession:
    app = request.app
    session = app.get(_SESSION_KEY)
    if session is None or session.closed:
        session = app[_SESSION_KEY] = aiohttp.ClientSession()
    return session


async def close_session(app: web.Application) -> None:
    session = app.get(_SESSION_KEY)
    if session is not None:
        await session.close()


async def pull_route(request: web.Request) -> web.Response:
    """POST /kv_transfer/pull (a producer): the leading blocks of `block_hashes` this engine holds, in the wire
    format of core/kv_transfer.py; 409 when the asking engine's fingerprint differs from this one's."""
    state = get_state(request)
    require_loaded(state)
    _role(state, produces=True)
    req: PullRequest = await read_json(request, PullRequest)
    try:
        hashes = [int(h) for h in req.block_hashes]
    except ValueError:
        raise APIError("block_hashes must be integers (decimal strings or numbers)", 400, param="block_hashes") from None
    if any(not 0 <= h < 1 << 64 for h in hashes):
        raise APIError("block_hashes must be unsigned 64-bit integers", 400, param="block_hashes")

    def export(engine):
        kt = engine.kv_transfer
        differs = kt.mismatch(req.fingerprint)
        if differs is not None:
            kt.release(req.hold_id)  # no consumer of this layout will take them
            return None, differs
        return kt.export(hashes, req.hold_id), None

    blobs, differs = await state.engine.run_in_engine(export)
    if differs is not None:
        raise APIError(f"KV layouts differ, no blocks can move between these engines: {differs}", 409,
                       code="kv_incompatible", param="fingerprint")
    state.metrics.kv_transfer_served(len(blobs))
    return web.Response(body=encode_blocks(hashes, blobs), content_type="application/octet-stream")


def add_routes(app: web.Application) -> None:
    app.router.add_post(PULL_PATH, pull_route)
    app.on_cleanup.append(close_session)
