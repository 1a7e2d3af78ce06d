"""Local stand-ins for the Hugging Face Hub and Ollama HTTP APIs, on 127.0.0.1 only.

They implement just the endpoints the real clients (huggingface_hub, ollama) call, and record
every request so tests can check what was sent, by whom, and what was not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json(self, code: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server:
    handler: type

    def __init__(self):
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler)
        self.httpd.owner = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def record(self, **entry) -> None:
        with self.lock:
            self.requests.append(entry)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class _HubHandler(_Handler):
    def do_GET(self):
        hub: FakeHub = self.server.owner
        hub.record(method="GET", path=self.path, auth=self.headers.get("authorization"))
        if "/tree/" in self.path:  # list_repo_files, used by upload_folder(delete_patterns=...)
            return self._json(200, [{"type": "file", "path": p, "oid": "0" * 40, "size": n} for p, n in sorted(hub.files.items())])
        self._json(404, {"error": "not found"})

    def do_POST(self):
        hub: FakeHub = self.server.owner
        body = self._body()
        auth = self.headers.get("authorization", "")
        agent = self.headers.get("user-agent", "")
        if hub.reject_with and "/commit/" in self.path:
            hub.record(method="POST", path=self.path, auth=auth, agent=agent, rejected=True)
            return self._json(hub.reject_with, {"error": "Invalid credentials in Authorization header"})
        if self.path == "/api/repos/create":
            payload = json.loads(body)
            hub.record(kind="create", auth=auth, agent=agent, **payload)
            return self._json(200, {"url": f"{hub.url}/{payload['organization']}/{payload['name']}"})
        if self.path.startswith("/api/validate-yaml"):
            return self._json(200, {"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        if "/commit/" in self.path:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(l["value"] for l in lines if l["key"] == "header")
            files = {l["value"]["path"]: base64.b64decode(l["value"]["content"]) for l in lines if l["key"] == "file"}
            deletes = [l["value"]["path"] for l in lines if l["key"] in ("deletedFile", "deletedFolder")]
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            hub.record(kind="commit", repo=repo, summary=header["summary"], files=files, deletes=deletes, auth=auth, agent=agent)
            for path in deletes:
                hub.files.pop(path, None)
            hub.files.update({path: len(content) for path, content in files.items()})
            oid = hashlib.sha1(body).hexdigest()
            return self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True})
        self._json(404, {"error": f"no route {self.path}"})


class FakeHub(_Server):
    handler = _HubHandler

    def __init__(self, reject_with: int | None = None):
        self.reject_with = reject_with
        self.files: dict[str, int] = {}  # the repo as the commits left it: path -> size
        super().__init__()

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.requests if r.get("kind") == kind]


class _OllamaHandler(_Handler):
    def do_HEAD(self):
        digest = self.path.rsplit("/", 1)[-1]
        self.send_response(200 if digest in self.server.owner.blobs else 404)
        self.end_headers()

    def do_POST(self):
        ollama: FakeOllama = self.server.owner
        body = self._body()
        if self.path.startswith("/api/blobs/"):
            digest = self.path.rsplit("/", 1)[-1]
            if digest != "sha256:" + hashlib.sha256(body).hexdigest():
                return self._json(400, {"error": "digest mismatch"})
            ollama.blobs[digest] = len(body)
            self.send_response(201)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/api/create":
            request = json.loads(body)
            missing = [d for d in list((request.get("files") or {}).values()) + list((request.get("adapters") or {}).values())
                       if d not in ollama.blobs]
            if missing:
                return self._json(400, {"error": f"unknown blob {missing[0]}"})
            ollama.record(kind="create", **request)
            return self._json(200, {"status": "success"})
        if self.path == "/api/push":
            ollama.record(kind="push", **json.loads(body))
            return self._json(200, {"status": "success"})
        self._json(404, {"error": f"no route {self.path}"})


class FakeOllama(_Server):
    handler = _OllamaHandler

    def __init__(self):
        self.blobs: dict[str, int] = {}
        super().__init__()

    def creates(self) -> list[dict]:
        return [r for r in self.requests if r.get("kind") == "create"]
