"""Local stand-ins for the Hugging Face Hub and Ollama HTTP APIs, on 127.0.0.1 only.

They implement just the endpoints the real clients (huggingface_hub, ollama) call, and record
every request so tests can check what was sent, by whom, and what was not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
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


LFS_SUFFIXES = (".safetensors", ".bin", ".pkl", ".pt", ".png")  # binary files go through LFS, as on the Hub


class _HubHandler(_Handler):
    def _authorized(self, method: str) -> bool:
        """Every endpoint refuses a missing or wrong token, like the Hub does for writes to a private repo."""
        hub: FakeHub = self.server.owner
        auth = self.headers.get("authorization", "")
        if hub.token is None or auth == f"Bearer {hub.token}":
            return True
        hub.record(method=method, path=self.path, auth=auth, rejected=True)
        self._json(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def do_GET(self):
        hub: FakeHub = self.server.owner
        if not self._authorized("GET"):
            return
        hub.record(method="GET", path=self.path, auth=self.headers.get("authorization"))
        if self.path.startswith("/api/models/") and "/tree/" not in self.path:  # model_info
            repo = self.path.split("?")[0][len("/api/models/"):]
            if repo not in hub.repos:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            return self._json(200, {"id": repo, "private": hub.repos[repo], "sha": "0" * 40})
        if "/tree/" in self.path:  # list_repo_files, used by upload_folder(delete_patterns=...)
            return self._json(200, [{"type": "file", "path": p, "oid": "0" * 40, "size": n} for p, n in sorted(hub.files.items())])
        self._json(404, {"error": "not found"})

    def do_PUT(self):
        hub: FakeHub = self.server.owner
        if not self.path.startswith("/lfs-upload/"):
            return self._json(404, {"error": "no route"})
        body = self._body()
        oid = self.path.rsplit("/", 1)[-1]
        if hashlib.sha256(body).hexdigest() != oid:
            return self._json(400, {"error": "sha256 mismatch"})
        hub.lfs[oid] = body
        hub.record(kind="lfs-upload", oid=oid, size=len(body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        hub: FakeHub = self.server.owner
        body = self._body()
        auth = self.headers.get("authorization", "")
        agent = self.headers.get("user-agent", "")
        if not self._authorized("POST"):
            return
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
            mode = lambda path: "lfs" if path.endswith(LFS_SUFFIXES) else "regular"
            return self._json(200, {"files": [{"path": f["path"], "uploadMode": mode(f["path"]), "shouldIgnore": False}
                                              for f in files]})
        if self.path.endswith(".git/info/lfs/objects/batch"):
            objects = json.loads(body)["objects"]
            return self._json(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "authenticated": True,
                 "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}", "header": {}}}} for o in objects]})
        if "/commit/" in self.path:
            if hub.hold is not None and not hub.held:  # the first commit waits until the test lets it go
                hub.held = True
                hub.hold.wait(timeout=120)
            if hub.delay:
                time.sleep(hub.delay)
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(l["value"] for l in lines if l["key"] == "header")
            files = {l["value"]["path"]: base64.b64decode(l["value"]["content"]) for l in lines if l["key"] == "file"}
            files.update({l["value"]["path"]: hub.lfs[l["value"]["oid"]] for l in lines if l["key"] == "lfsFile"})
            deletes = [l["value"]["path"] for l in lines if l["key"] in ("deletedFile", "deletedFolder")]
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            hub.record(kind="commit", repo=repo, summary=header["summary"], files=files, deletes=deletes, auth=auth, agent=agent,
                       lfs=[l["value"]["path"] for l in lines if l["key"] == "lfsFile"], finished=time.time())
            for path in deletes:
                hub.files.pop(path, None)
            hub.files.update({path: len(content) for path, content in files.items()})
            oid = hashlib.sha1(body).hexdigest()
            return self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True})
        self._json(404, {"error": f"no route {self.path}"})


class FakeHub(_Server):
    """token: the only token accepted (None: any); hold: an Event the first commit waits for; delay: seconds per commit;
    repos: repositories that already exist (id -> private)."""

    handler = _HubHandler

    def __init__(self, token: str | None = None, reject_with: int | None = None, hold: threading.Event | None = None,
                 delay: float = 0.0, repos: dict[str, bool] | None = None):
        self.token, self.reject_with, self.hold, self.held, self.delay = token, reject_with, hold, False, delay
        self.repos = dict(repos or {})  # repos that exist before the run: id -> private
        self.files: dict[str, int] = {}  # the repo as the commits left it: path -> size
        self.lfs: dict[str, bytes] = {}  # uploaded LFS objects by sha256
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
            ollama.heads[digest] = body[:4]
            if len(body) < 1 << 20:
                ollama.contents[digest] = body
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
            files = request.get("files") or {}
            if any(name.endswith(".gguf") for name in files):  # Ollama's GGUF import: one file, GGUF magic
                if len(files) != 1 or ollama.heads.get(next(iter(files.values()))) != b"GGUF":
                    return self._json(400, {"error": "invalid file magic"})
            elif files and ("config.json" not in files or not {"tokenizer.json", "tokenizer.model"} & set(files)):
                return self._json(400, {"error": "unknown model architecture: config.json and tokenizer files are required"})
            if request.get("adapters") and files:  # like Ollama's converter: LoRA adapters for llama and gemma2 only
                config = json.loads(ollama.contents[files["config.json"]])
                if config["architectures"][0] not in ("LlamaForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM"):
                    return self._json(400, {"error": "unsupported architecture"})
            ollama.record(kind="create", **request)
            return self._json(200, {"status": "success"})
        if self.path == "/api/push":
            request = json.loads(body)
            if "/" not in request["model"]:
                return self._json(401, {"error": "you are not authorized to push to this namespace, create the model "
                                                  "under a namespace you own"})
            ollama.record(kind="push", **request)
            return self._json(200, {"status": "success"})
        self._json(404, {"error": f"no route {self.path}"})


class FakeOllama(_Server):
    handler = _OllamaHandler

    def __init__(self):
        self.blobs: dict[str, int] = {}
        self.contents: dict[str, bytes] = {}  # small blobs (config.json...), as the server would read them
        self.heads: dict[str, bytes] = {}  # every blob's first 4 bytes (a GGUF file's magic)
        super().__init__()

    def creates(self) -> list[dict]:
        return [r for r in self.requests if r.get("kind") == "create"]
