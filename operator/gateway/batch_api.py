"""OpenAI's Files and Batches routes on the gateway (`--batch-dir`): upload a JSONL of requests, create a batch of
them, follow its progress, cancel it, download its output and error files.

  POST /v1/files (multipart: purpose=batch, file)   GET /v1/files   GET /v1/files/{id}   GET /v1/files/{id}/content
  DELETE /v1/files/{id}   POST /v1/batches   GET /v1/batches   GET /v1/batches/{id}   POST /v1/batches/{id}/cancel

Every route authenticates as the proxied ones do (the gateway's key, or the shared gateway's tenant keys); a file
or batch belongs to the tenant that created it (tenants.py: per-service gateways have one tenant), and any other
tenant gets the 404 an unknown id gets. State lives in batch_store.Store; batch_runner.BatchRunner runs batches.
"""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web

from shoal.operator.gateway.batch_runner import BatchRunner
from shoal.operator.gateway.batch_store import TERMINAL, BatchError, Store, validate_create

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
LIST_LIMIT = 100


def error_response(e: BatchError) -> web.Response:
    return web.json_response({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                        "code": e.code}}, status=e.status)


class BatchAPI:
    def __init__(self, gateway, directory: str, per_engine: int = 2, max_file_bytes: int = MAX_FILE_BYTES,
                 share: str = "idle"):
        self.gateway = gateway
        self.store = Store(directory)
        self.runner = BatchRunner(gateway, self.store, per_engine, share)
        self.max_file_bytes = max_file_bytes

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for method, path, handler in (
                ("POST", "/v1/files", self.upload), ("GET", "/v1/files", self.list_files),
                ("GET", "/v1/files/{file_id}", self.get_file),
                ("GET", "/v1/files/{file_id}/content", self.file_content),
                ("DELETE", "/v1/files/{file_id}", self.delete_file),
                ("POST", "/v1/batches", self.create), ("GET", "/v1/batches", self.list),
                ("GET", "/v1/batches/{batch_id}", self.get), ("POST", "/v1/batches/{batch_id}/cancel", self.cancel)):
            router.add_route(method, path, self._guarded(handler))

    def _guarded(self, handler):
        """Authenticate (401 as the proxy does), then run the handler with the caller; BatchError → its answer."""
        async def route(request: web.Request) -> web.StreamResponse:
            caller = self.gateway._authenticate(request)
            if caller is None:
                return self.gateway._unauthenticated()
            try:
                return await handler(request, caller)
            except BatchError as e:
                return error_response(e)
        return route

    # ---- files -----------------------------------------------------------------------------------------------
    async def upload(self, request: web.Request, caller) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise BatchError(400, "upload a file as multipart/form-data with fields `purpose` and `file`",
                             "invalid_body")
        reader = await request.multipart()
        purpose, filename, tmp = None, None, None
        try:
            while (part := await reader.next()) is not None:
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file" and tmp is None:
                    filename = part.filename or "upload.jsonl"
                    tmp = self.store.upload_path()
                    await self._save_part(part, tmp)
            if purpose != "batch":
                raise BatchError(400, f"`purpose` must be \"batch\" (the only purpose this gateway stores); got "
                                      f"{purpose!r}", "invalid_value", "purpose")
            if tmp is None:
                raise BatchError(400, "the upload has no `file` part", "missing_required_parameter", "file")
            obj = await asyncio.to_thread(self.store.add_file, tmp, caller.tenant, filename, purpose)
            tmp = None
            return web.json_response(obj)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    async def _save_part(self, part, tmp: str) -> None:
        size = 0
        with open(tmp, "wb") as f:
            while chunk := await part.read_chunk(1 << 20):
                size += len(chunk)
                if size > self.max_file_bytes:
                    raise BatchError(413, f"the file exceeds {self.max_file_bytes} bytes", "file_too_large", "file")
                f.write(chunk)

    async def list_files(self, request: web.Request, caller) -> web.Response:
        """The caller's files, newest first (or `order=asc`), by `purpose` when given, `limit`/`after` pages."""
        limit = _limit(request, default=10_000, most=10_000)
        files = await asyncio.to_thread(self.store.list_files, caller.tenant)
        if purpose := request.query.get("purpose"):
            files = [f for f in files if f["purpose"] == purpose]
        files.sort(key=lambda f: (f["created_at"], f["id"]), reverse=request.query.get("order", "desc") != "asc")
        return web.json_response(_page(files, request.query.get("after"), limit))

    async def get_file(self, request: web.Request, caller) -> web.Response:
        return web.json_response(await asyncio.to_thread(self.store.get_file, request.match_info["file_id"],
                                                         caller.tenant))

    async def file_content(self, request: web.Request, caller) -> web.StreamResponse:
        path = await asyncio.to_thread(self.store.file_content_path, request.match_info["file_id"], caller.tenant)
        return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})

    async def delete_file(self, request: web.Request, caller) -> web.Response:
        return web.json_response(await asyncio.to_thread(self.store.delete_file, request.match_info["file_id"],
                                                         caller.tenant))

    # ---- batches ---------------------------------------------------------------------------------------------
    async def create(self, request: web.Request, caller) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            raise BatchError(400, "the request body is not valid JSON", "invalid_body") from None
        file_id, endpoint, window, metadata = validate_create(body)
        record, _ = await asyncio.to_thread(self.store.create_batch, caller.tenant, caller.namespace, file_id,
                                            endpoint, window, metadata)
        batch_id = record["batch"]["id"]
        await self.runner.adopt(batch_id)
        return web.json_response(self._view(batch_id, record))

    def _view(self, batch_id: str, record: dict) -> dict:
        live = self.runner.current(batch_id)
        return dict((live or record)["batch"])

    async def _record(self, request: web.Request, caller) -> tuple[str, dict]:
        batch_id = request.match_info["batch_id"]
        return batch_id, await asyncio.to_thread(self.store.get_batch, batch_id, caller.tenant)

    async def get(self, request: web.Request, caller) -> web.Response:
        batch_id, record = await self._record(request, caller)
        view = self._view(batch_id, record)
        if view["status"] not in TERMINAL and view["status"] != "cancelling" and \
                await asyncio.to_thread(self.store.cancel_asked, batch_id):
            view["status"] = "cancelling"  # asked through this replica, not yet seen by the runner
        return web.json_response(view)

    async def cancel(self, request: web.Request, caller) -> web.Response:
        batch_id, record = await self._record(request, caller)
        view = self._view(batch_id, record)
        if view["status"] in ("cancelling", "cancelled"):
            return web.json_response(view)
        if view["status"] in TERMINAL:
            raise BatchError(400, f"Cannot cancel a batch with status '{view['status']}'.", "invalid_state")
        await asyncio.to_thread(self.store.ask_cancel, batch_id)
        self.runner.wake()
        view = self._view(batch_id, record)
        if view["status"] not in TERMINAL:
            view["status"] = "cancelling"
        return web.json_response(view)

    async def list(self, request: web.Request, caller) -> web.Response:
        limit = _limit(request, default=20, most=LIST_LIMIT)
        records = await asyncio.to_thread(lambda: list(self.store.records(caller.tenant)))
        views = sorted((self._view(r["batch"]["id"], r) for r in records),
                       key=lambda b: (b["created_at"], b["id"]), reverse=True)  # newest first, as OpenAI lists
        return web.json_response(_page(views, request.query.get("after"), limit))


def _limit(request: web.Request, default: int, most: int) -> int:
    try:
        limit = int(request.query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise BatchError(400, f"`limit` must be a whole number from 1 to {most}", "invalid_value", "limit")
    return limit


def _page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's cursor page: the items after the one with id `after`, at most `limit`."""
    if after:
        ids = [x["id"] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
