"""A fake Hugging Face hub on 127.0.0.1 for the download tests (the `hf` fixture in conftest.py).

It speaks as much of the hub as huggingface_hub's downloads use, and can misbehave the ways a real
connection does: drop a transfer part way, stay down after that, or stall until the test lets it go.
Every request is logged with its Range header and the bytes of the body it was sent.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
import urllib.parse

PIECE = 1 << 20  # a body is written in pieces of this size, so that it can stop or stall between two


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeHF(http.server.ThreadingHTTPServer):
    """HEAD and GET on /{repo}/resolve/{revision}/{file} answering with X-Repo-Commit, ETag /
    X-Linked-Etag and X-Linked-Size; the revision may also be that commit; an LFS file is a 302 to a
    "CDN" on another host name (localhost instead of 127.0.0.1); Range requests.

    A file added with ``cut_at=N`` has its first GET cut after N bytes (the headers promise all of
    it); with ``down_after_cut`` every GET after that is a 503 until the test sets ``down`` to False.
    A file added with ``stall_at=N`` has its first GET stop at byte N of the file until ``release``
    is set.  ``log`` holds a dict per request: method, path, range, auth, host, sent (body bytes).
    """

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeHFHandler)
        self.files: dict[tuple[str, str, str], dict] = {}
        self.log: list[dict] = []
        self.down = False  # the hub answers every GET with a 503
        self.stalled = threading.Event()  # a GET has reached its stall_at
        self.release = threading.Event()  # lets a stalled GET go on

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def environment(self, home: str) -> dict[str, str]:
        """os.environ for a process that downloads from this hub: huggingface_hub's home (its cache
        and token file) in ``home``, no token, no proxy, and a read timeout longer than a test keeps
        a transfer stalled (else huggingface_hub would time out and retry on its own)."""
        drop = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "hf_token", "hugging_face_hub_token", "hf_home",
                "hf_hub_cache", "huggingface_hub_cache", "hf_token_path"}
        env = {k: v for k, v in os.environ.items() if k.lower() not in drop}
        return env | {"HF_ENDPOINT": self.endpoint, "HF_HOME": home, "HF_HUB_DOWNLOAD_TIMEOUT": "60"}

    @staticmethod
    def commit(repo: str, revision: str) -> str:
        return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()

    def add(self, repo: str, file: str, data: bytes, *, revision: str = "main", etag: str | None = "auto",
            redirect: bool = False, status: int = 200, cut_at: int | None = None, down_after_cut: bool = False,
            stall_at: int | None = None) -> bytes:
        """etag: the sha256 an LFS file publishes ("auto": the right one), None for a git file (a sha1)."""
        etag = sha(data) if etag == "auto" else etag
        self.files[(repo, revision, file)] = dict(data=data, etag=etag, redirect=redirect, status=status,
                                                  cut_at=cut_at, down_after_cut=down_after_cut, stall_at=stall_at)
        return data

    def find(self, repo: str, revision: str, file: str) -> dict | None:
        for (r, rev, f), entry in self.files.items():
            if (r, f) == (repo, file) and revision in (rev, self.commit(r, rev)):
                return entry | {"revision": rev}
        return None

    def file_requests(self) -> list[dict]:
        """The requests for files (not, say, the agent-harness list huggingface_hub 2 fetches once a
        day into a new HF_HOME), in order."""
        return [e for e in self.log if "/resolve/" in e["path"]]

    def gets(self) -> list[dict]:
        """The GETs that reached a file's bytes (the hub's or the CDN's), in order."""
        return [e for e in self.file_requests() if e["method"] == "GET" and e["status"] in (200, 206)]


class FakeHFHandler(http.server.BaseHTTPRequestHandler):
    server: FakeHF
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(head=True)

    def do_GET(self):
        self.answer(head=False)

    def answer(self, head: bool):
        self.entry = {"method": self.command, "path": urllib.parse.unquote(self.path),
                      "range": self.headers.get("Range"), "auth": self.headers.get("Authorization"),
                      "host": self.headers.get("Host"), "status": None, "sent": 0}
        self.server.log.append(self.entry)
        parts = self.path.split("/")
        cdn = parts[1] == "cdn"
        parts = parts[1:] if cdn else parts
        if len(parts) < 6 or parts[3] != "resolve":
            return self.reply(404, b"", head, {"X-Error-Code": "RepoNotFound"})
        repo = urllib.parse.unquote(f"{parts[1]}/{parts[2]}")
        revision, file = urllib.parse.unquote(parts[4]), urllib.parse.unquote("/".join(parts[5:]))
        f = self.server.find(repo, revision, file)
        if f is None:
            return self.reply(404, b"", head, {"X-Error-Code": "EntryNotFound"})
        if f["status"] != 200:
            return self.reply(f["status"], b"", head)
        data = f["data"]
        meta = {"X-Repo-Commit": self.server.commit(repo, f["revision"])}
        if f["etag"] is None:
            meta["ETag"] = f'"{hashlib.sha1(data).hexdigest()}"'
        else:
            meta |= {"ETag": f'"{f["etag"]}"', "X-Linked-Etag": f'"{f["etag"]}"', "X-Linked-Size": str(len(data))}
        if f["redirect"] and not cdn:
            cdn_url = f"http://localhost:{self.server.server_address[1]}/cdn{self.path}"
            return self.reply(302, b"", head, {"Location": cdn_url, **meta})
        if head:
            return self.reply(200, data, head, meta)
        if self.server.down:
            return self.reply(503, b"", head)
        entry = self.server.files[(repo, f["revision"], file)]
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
        if start:
            meta["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send(206 if start else 200, data, start, meta, entry)

    def send(self, code: int, data: bytes, start: int, headers: dict, entry: dict):
        """The body from byte ``start`` of the file in pieces, cut or stalled as the file's entry says
        (each once)."""
        end, entry["cut_at"] = (len(data) if entry["cut_at"] is None else start + entry["cut_at"]), None
        stall, entry["stall_at"] = entry["stall_at"], None
        self.entry["status"] = code
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        try:
            at = start
            while at < end:
                if stall is not None and at >= stall:
                    stall = None
                    self.server.stalled.set()
                    self.server.release.wait(60)
                n = min(PIECE, end - at, (stall - at) if stall is not None else PIECE)
                self.wfile.write(data[at:at + n])
                self.wfile.flush()
                at += n
                self.entry["sent"] += n
        except (BrokenPipeError, ConnectionResetError):  # the client went away (it was killed)
            self.close_connection = True
            return
        if end < len(data):  # hang up part way
            self.close_connection = True
            self.server.down = self.server.down or entry["down_after_cut"]

    def reply(self, code: int, body: bytes, head: bool, headers: dict | None = None):
        self.entry["status"] = code
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
