"""A Hugging Face hub on 127.0.0.1 for huggingface_hub to talk to (HF_ENDPOINT): the calls
nibble's downloads make, a repo's info (`/api/models/ORG/NAME[/revision/REV]`), its list of files
(`.../tree/REV`) and its files (`/ORG/NAME/resolve/REV/PATH`, HEAD and GET, with byte ranges),
and a way to cut a download."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>.+))?")
_TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)")
_FILE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")


class FakeHub:
    """repos: repo id -> {path: bytes}, all at one commit. `cut[path] = n`: the next GET of that file
    sends its first n bytes (under the whole file's Content-Length) and drops the connection.
    `damaged[path] = n`: the next n GETs of that file send it with its last byte changed (a
    download damaged on its way, its headers as the file's). `requests` logs (method, path, Range
    header) in order."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.cut: dict[str, int] = {}
        self.damaged: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # shutdown() returns once the loop next looks, every poll_interval (0.5 s by default)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                path = self.path.split("?")[0]
                if m := _TREE.fullmatch(path):
                    files = hub.repos.get(m["repo"], {})
                    tree = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                            for f, d in files.items()]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
                if m := _INFO.fullmatch(path):
                    files = hub.repos.get(m["repo"])
                    if files is None:
                        return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
                    info = {"id": m["repo"], "sha": hub.commit(m["repo"]),
                            "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
                m = _FILE.fullmatch(path)
                data = hub.repos.get(m["repo"], {}).get(m["path"]) if m else None
                if data is None:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                headers = {"X-Repo-Commit": hub.commit(m["repo"]),
                           "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
                start = int(re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "bytes=0-")[1])
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                if body and hub.damaged.get(m["path"]):
                    hub.damaged[m["path"]] -= 1
                    data = data[:-1] + bytes([data[-1] ^ 1])
                part = data[start:]
                if body and (n := hub.cut.pop(m["path"], None)) is not None:
                    self.send_response(206 if start else 200)
                    for k, v in {**headers, "Content-Length": str(len(part))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(part[:n])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self._send(206 if start else 200, part, headers, body)

            def _send(self, status: int, data: bytes, headers: dict, body: bool):
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
