"""OpenAI Batches' durable state: uploaded files and batches, on a directory (`--batch-dir`, a volume).

Layout (every JSON document written whole: a temporary file, fsync, rename, fsync of the directory)::

    files/<file-id>.json         {"file": <OpenAI file object>, "owner": tenant}
    files/<file-id>.data         the content
    batches/<batch-id>/batch.json  {"batch": <OpenAI batch object>, "owner": tenant, "namespace": ns}
    batches/<batch-id>/input.jsonl   the input file as it was when the batch was created (a deleted input file
                                     does not stop the batch)
    batches/<batch-id>/output.jsonl  finished requests: appended and fsynced one group at a time, each line with
    batches/<batch-id>/errors.jsonl  its custom_id, before the request counts as done
    batches/<batch-id>/cancel    present once a cancel was asked (by any gateway replica)
    batches/<batch-id>/lock      flock()ed by the one gateway process running the batch

A restarted gateway resumes a batch from its output and error files: the custom_ids found there are done (a line
torn by a crash mid-write is cut off first), every other input line runs, so a finished request is neither lost
nor run twice. Only the process holding the lock writes batch.json and appends results.

Validation of an input file at create time (`parse_input`) refuses what OpenAI's validation refuses — a line that
is not a JSON object, no custom_id, a duplicate custom_id, a method other than POST, a url other than the batch's
endpoint, a body that is not an object naming a `model`, `stream: true` — as one 400 naming the line.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any, Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_LINES = 50_000  # OpenAI's limit of requests per batch
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


class BatchError(Exception):
    """A request the Batches API refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, doc: Any) -> None:
    """Replace `path` with `doc` atomically and durably."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class Line:
    """One request of a batch's input."""

    index: int  # 0-based line number among the non-blank lines
    custom_id: str
    url: str
    body: dict


def parse_input(data: bytes, endpoint: str) -> list[Line]:
    """The requests of an input file for `endpoint`, or BatchError 400 naming the first bad line."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue

        def bad(why: str) -> BatchError:
            return BatchError(400, f"input file line {number}: {why}", "invalid_batch_line", "input_file_id")

        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise bad(f"not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise bad("not a JSON object")
        custom_id = doc.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad("`custom_id` must be a non-empty string")
        if custom_id in seen:
            raise bad(f"duplicate custom_id {custom_id!r}: each request's custom_id must be unique in the batch")
        if doc.get("method") != "POST":
            raise bad(f"`method` must be \"POST\", got {doc.get('method')!r}")
        if doc.get("url") != endpoint:
            raise bad(f"`url` {doc.get('url')!r} is not the batch's endpoint {endpoint}")
        body = doc.get("body")
        if not isinstance(body, dict):
            raise bad("`body` must be a JSON object")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise bad("`body.model` must name a model")
        if body.get("stream"):
            raise bad("`body.stream` is not supported in a batch")
        seen.add(custom_id)
        lines.append(Line(len(lines), custom_id, endpoint, body))
        if len(lines) > MAX_LINES:
            raise BatchError(400, f"the input file holds more than {MAX_LINES} requests", "too_many_requests",
                             "input_file_id")
    if not lines:
        raise BatchError(400, "the input file holds no request", "empty_file", "input_file_id")
    return lines


def validate_create(body: Any) -> tuple[str, str, str, dict | None]:
    """(input_file_id, endpoint, completion_window, metadata) of a POST /v1/batches body, or BatchError 400."""
    if not isinstance(body, dict):
        raise BatchError(400, "the request body must be a JSON object", "invalid_body")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise BatchError(400, "`input_file_id` is required", "missing_required_parameter", "input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise BatchError(400, f"`endpoint` must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}",
                         "invalid_value", "endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise BatchError(400, f"`completion_window` must be \"24h\"; got {window!r}", "invalid_value",
                         "completion_window")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()):
            raise BatchError(400, "`metadata` is at most 16 string pairs (keys up to 64 characters, values up to "
                                  "512)", "invalid_value", "metadata")
    return file_id, endpoint, window, metadata


class Store:
    """Files and batches under `root`, each owned by the tenant that created it: another tenant's id reads as an
    unknown one (404)."""

    def __init__(self, root: str):
        self.root = root
        self.files_dir = os.path.join(root, "files")
        self.batches_dir = os.path.join(root, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)
        probe = os.path.join(root, f".probe-{secrets.token_hex(4)}")
        with open(probe, "w"):  # a read-only volume fails at start-up, not at the first upload
            pass
        os.unlink(probe)

    # ---- files -----------------------------------------------------------------------------------------------
    def _file_paths(self, file_id: str) -> tuple[str, str]:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise self._no_file(file_id)
        return (os.path.join(self.files_dir, file_id + ".json"), os.path.join(self.files_dir, file_id + ".data"))

    @staticmethod
    def _no_file(file_id: str) -> BatchError:
        return BatchError(404, f"No such File object: {file_id}", "file_not_found", "file_id")

    def upload_path(self) -> str:
        """Where an upload is written before `add_file` adopts it."""
        return os.path.join(self.files_dir, f".upload-{secrets.token_hex(8)}")

    def add_file(self, tmp: str, owner: str, filename: str, purpose: str) -> dict:
        """Adopt the uploaded content at `tmp` (durably) as a new file; its OpenAI file object."""
        file_id = new_id("file-")
        meta_path, data_path = self._file_paths(file_id)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, data_path)
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "status_details": None}
        write_json(meta_path, {"file": obj, "owner": owner})
        return obj

    def get_file(self, file_id: str, owner: str) -> dict:
        meta_path, _ = self._file_paths(file_id)
        try:
            doc = read_json(meta_path)
        except (OSError, ValueError):
            raise self._no_file(file_id) from None
        if doc.get("owner") != owner:
            raise self._no_file(file_id)
        return doc["file"]

    def list_files(self, owner: str) -> list[dict]:
        out = []
        for name in os.listdir(self.files_dir):
            if name.startswith("file-") and name.endswith(".json"):
                try:
                    doc = read_json(os.path.join(self.files_dir, name))
                except (OSError, ValueError):  # deleted meanwhile
                    continue
                if doc.get("owner") == owner:
                    out.append(doc["file"])
        return out

    def file_content_path(self, file_id: str, owner: str) -> str:
        self.get_file(file_id, owner)
        return self._file_paths(file_id)[1]

    def delete_file(self, file_id: str, owner: str) -> dict:
        self.get_file(file_id, owner)
        meta_path, data_path = self._file_paths(file_id)
        os.unlink(meta_path)  # the metadata first: a crash in between leaves content nobody can name, not a
        try:                  # file object without content
            os.unlink(data_path)
        except FileNotFoundError:
            pass
        _fsync_dir(self.files_dir)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ---------------------------------------------------------------------------------------------
    def batch_dir(self, batch_id: str) -> str:
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum():
            raise self._no_batch(batch_id)
        return os.path.join(self.batches_dir, batch_id)

    @staticmethod
    def _no_batch(batch_id: str) -> BatchError:
        return BatchError(404, f"No batch found with id '{batch_id}'", "batch_not_found", "batch_id")

    def create_batch(self, owner: str, namespace: str | None, input_file_id: str, endpoint: str, window: str,
                     metadata: dict | None) -> tuple[dict, list[Line]]:
        """Validate the input file and record a new batch (status "validating"): its record and its requests."""
        data_path = self.file_content_path(input_file_id, owner)
        if self.get_file(input_file_id, owner)["purpose"] != "batch":
            raise BatchError(400, f"file {input_file_id} was not uploaded with purpose \"batch\"", "invalid_value",
                             "input_file_id")
        with open(data_path, "rb") as f:
            data = f.read()
        lines = parse_input(data, endpoint)
        batch_id = new_id("batch_")
        path = self.batch_dir(batch_id)
        os.makedirs(path)
        with open(os.path.join(path, "input.jsonl"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        now = int(time.time())
        batch = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + COMPLETION_WINDOWS[window], "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": metadata}
        record = {"batch": batch, "owner": owner, "namespace": namespace}
        write_json(os.path.join(path, "batch.json"), record)
        _fsync_dir(self.batches_dir)
        return record, lines

    def load(self, batch_id: str) -> dict:
        """A batch's record, whoever owns it (BatchError 404 when there is none)."""
        try:
            return read_json(os.path.join(self.batch_dir(batch_id), "batch.json"))
        except (OSError, ValueError):
            raise self._no_batch(batch_id) from None

    def get_batch(self, batch_id: str, owner: str) -> dict:
        record = self.load(batch_id)
        if record.get("owner") != owner:
            raise self._no_batch(batch_id)
        return record

    def save(self, record: dict) -> None:
        write_json(os.path.join(self.batch_dir(record["batch"]["id"]), "batch.json"), record)

    def batch_ids(self) -> list[str]:
        return sorted(n for n in os.listdir(self.batches_dir) if n.startswith("batch_"))

    def records(self, owner: str) -> Iterator[dict]:
        for batch_id in self.batch_ids():
            try:
                record = self.load(batch_id)
            except BatchError:  # being created by another replica
                continue
            if record.get("owner") == owner:
                yield record

    def ask_cancel(self, batch_id: str) -> None:
        path = os.path.join(self.batch_dir(batch_id), "cancel")
        with open(path, "w") as f:
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(os.path.dirname(path))

    def cancel_asked(self, batch_id: str) -> bool:
        return os.path.exists(os.path.join(self.batch_dir(batch_id), "cancel"))

    def lock(self, batch_id: str) -> int | None:
        """Take the batch's run lock (non-blocking): a file descriptor to close when done, or None when another
        process holds it."""
        fd = os.open(os.path.join(self.batch_dir(batch_id), "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    def input_lines(self, record: dict) -> list[Line]:
        batch = record["batch"]
        with open(os.path.join(self.batch_dir(batch["id"]), "input.jsonl"), "rb") as f:
            return parse_input(f.read(), batch["endpoint"])

    def finished(self, batch_id: str) -> tuple[set[str], set[str]]:
        """The custom_ids in the output file and in the error file, after cutting off a line torn by a crash."""
        out = []
        for name in ("output.jsonl", "errors.jsonl"):
            path = os.path.join(self.batch_dir(batch_id), name)
            ids: set[str] = set()
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                out.append(ids)
                continue
            end = data.rfind(b"\n") + 1
            if end < len(data):
                os.truncate(path, end)  # the tail of a write the crash interrupted: that request runs again
            for raw in data[:end].splitlines():
                ids.add(json.loads(raw)["custom_id"])
            out.append(ids)
        return out[0], out[1]

    def append(self, batch_id: str, results: list[tuple[str, bytes]]) -> None:
        """Append result lines (("output.jsonl" | "errors.jsonl", line)) and fsync them: done once this returns."""
        by_file: dict[str, list[bytes]] = {}
        for name, line in results:
            by_file.setdefault(name, []).append(line)
        for name, lines in by_file.items():
            path = os.path.join(self.batch_dir(batch_id), name)
            created = not os.path.exists(path)
            with open(path, "ab") as f:
                f.write(b"".join(line + b"\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
            if created:
                _fsync_dir(os.path.dirname(path))

    def publish_result(self, record: dict, name: str, file_id: str) -> str | None:
        """Make the batch's output or error file (`name`) a file object `file_id` of its owner (idempotent: a
        crash after the move is finished on resume); None when the batch wrote no such line."""
        batch_id = record["batch"]["id"]
        src = os.path.join(self.batch_dir(batch_id), name)
        meta_path, data_path = self._file_paths(file_id)
        if os.path.exists(meta_path):
            return file_id
        if os.path.exists(src):
            if os.path.getsize(src) == 0:
                return None
            shutil.copyfile(src, data_path + ".tmp")  # a copy: the batch's own stays for a resume's bookkeeping
            with open(data_path + ".tmp", "rb") as f:
                os.fsync(f.fileno())
            os.replace(data_path + ".tmp", data_path)
        elif not os.path.exists(data_path):
            return None
        obj = {"id": file_id, "object": "file", "bytes": os.path.getsize(data_path),
               "created_at": int(time.time()), "filename": f"{batch_id}_{name.split('.')[0]}.jsonl",
               "purpose": "batch_output", "status": "processed", "status_details": None}
        write_json(meta_path, {"file": obj, "owner": record["owner"]})
        return file_id
