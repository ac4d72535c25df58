"""A local stand-in for the Hugging Face Hub that serves model folders over the hub's HTTP API, enough for
`huggingface_hub.snapshot_download` (repo info, HEAD/GET of /<repo>/resolve/<rev>/<file>, Range requests), with
the hub's ETags (sha256 for "LFS" files — .safetensors here — the git blob sha1 otherwise). It counts file
downloads, so a test can tell a cached start from a download."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _etag(name: str, data: bytes) -> str:
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, tuple[str, dict[str, bytes]]] = {}  # repo -> (commit, {file: bytes})
        self.downloads: Counter = Counter()  # (repo, file) -> GETs of its content
        self.corrupt: set[tuple[str, str]] = set()  # served with a flipped byte (a bad transfer)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)) if not head or status != 200
                                 else (headers or {}).get("X-Size", "0"))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                path = self.path.split("?", 1)[0]
                if path.startswith("/api/models/"):
                    rest = path[len("/api/models/"):]
                    if "/tree/" in rest:
                        repo, _, _rev = rest.partition("/tree/")
                        if repo not in hub.repos:
                            return self._send(404, b'{"error": "Repository not found"}',
                                              {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                        tree = [{"type": "file", "path": f, "size": len(d), "oid": _etag(f + ".git", d),
                                 **({"lfs": {"oid": _etag(f, d), "size": len(d), "pointerSize": 134}}
                                    if f.endswith(".safetensors") else {})}
                                for f, d in hub.repos[repo][1].items()]
                        return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
                    repo, _, rev = rest.partition("/revision/")
                    if repo not in hub.repos:
                        return self._send(404, b'{"error": "Repository not found"}',
                                          {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                    commit, files = hub.repos[repo]
                    body = json.dumps({"id": repo, "modelId": repo, "sha": commit, "private": False,
                                       "siblings": [{"rfilename": f, "size": len(d)} for f, d in files.items()]})
                    return self._send(200, body.encode(), {"Content-Type": "application/json"})
                parts = path.strip("/").split("/")
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, fname = "/".join(parts[:2]), "/".join(parts[4:])
                    if repo not in hub.repos or fname not in hub.repos[repo][1]:
                        return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})
                    commit, files = hub.repos[repo]
                    data = files[fname]
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{_etag(fname, data)}"',
                               "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                    if head:
                        return self._send(200, b"", {**headers, "X-Size": str(len(data))}, head=True)
                    hub.downloads[(repo, fname)] += 1
                    if (repo, fname) in hub.corrupt:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    start = 0
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start = int(rng[6:].split("-")[0] or 0)
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                        return self._send(206, data[start:], headers)
                    return self._send(200, data, headers)
                return self._send(404, b"no such route")

            def do_GET(self):
                self._route(head=False)

            def do_HEAD(self):
                self._route(head=True)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def publish(self, repo: str, folder: Path, commit: str = "c" * 40) -> None:
        """Serve every file of a model folder as `repo` at `commit` (also its `main`)."""
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        self.repos[repo] = (commit, files)

    def file_downloads(self, repo: str) -> int:
        return sum(n for (r, _f), n in self.downloads.items() if r == repo)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeHub":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
