"""A local object store standing in for a remote one: a folder served over HTTP in a thread, with
a fixed delay per request, in the URL layout of the Hugging Face Hub, so that mosaicml-streaming's
own `hf://` downloader (huggingface_hub's hf_hub_download, over real HTTP) fetches from it.

    with DelayedHub(folder, delay_s=0.3) as hub:
        subprocess.run([...], env={**os.environ, **hub.env()})   # a process reading data.path =
        hub.data_path                                            # "hf://datasets/stand-in/data"
        hub.requests                                             # (method, path) served so far

Each file is one HEAD (metadata) and one GET (bytes), each answered after `delay_s`; the HEAD
carries the headers huggingface_hub needs (X-Repo-Commit, ETag, Content-Length). The reading
process is another one, started with `hub.env()` (HF_ENDPOINT pointing here), since
huggingface_hub reads HF_ENDPOINT once, when it is imported.
"""
from __future__ import annotations

import hashlib
import http.server
import os
import threading
import time
import urllib.parse

REPO = "stand-in/data"
COMMIT = "0" * 40


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        return None

    def _file(self) -> str | None:
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
        prefix = f"/datasets/{REPO}/resolve/"
        if not path.startswith(prefix):
            return None
        relative = path[len(prefix):].split("/", 1)[-1]  # drop the revision
        full = os.path.realpath(os.path.join(self.server.root, relative))
        return full if full.startswith(self.server.root + os.sep) and os.path.isfile(full) else None

    def _answer(self, body: bool) -> None:
        time.sleep(self.server.delay_s)
        self.server.requests.append((self.command, self.path))
        file = self._file()
        if file is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(file)
        etag = hashlib.sha256(f"{file}:{size}:{os.path.getmtime(file)}".encode()).hexdigest()
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if body:
            with open(file, "rb") as f:
                self.wfile.write(f.read())

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)


class DelayedHub:
    """Serves `folder` at http://127.0.0.1:<port> as the dataset repository stand-in/data."""

    def __init__(self, folder: str, delay_s: float) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.root = os.path.realpath(folder)
        self.server.delay_s = delay_s
        self.server.requests = []
        self._thread = threading.Thread(target=self.server.serve_forever, name="object-store", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def data_path(self) -> str:
        return f"hf://datasets/{REPO}"

    @property
    def requests(self) -> list:
        return self.server.requests

    def env(self) -> dict[str, str]:
        """Environment for a process that downloads from this store."""
        return {"HF_ENDPOINT": self.endpoint, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}

    def __enter__(self) -> "DelayedHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
