"""A real HTTP file server for tests, in its own process on 127.0.0.1: HEAD and GET of the files under a folder,
with single byte ranges (206 Partial Content), Content-Length and an ETag that changes with the file, as object
stores and CDNs serve them. Python's own http.server answers no ranges, which range-read serving needs.

Run as a script: `python http_server.py FOLDER PORT`."""

from __future__ import annotations

import re
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from ports import free_port
from s3_server import start_process, stop_process

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(BaseHTTPRequestHandler):
    root = Path(".")

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = (self.root / unquote(urlparse(self.path).path).lstrip("/")).resolve()
        if self.root not in path.parents or not path.is_file():
            self.send_error(404)
            return
        status = path.stat()
        start, end = 0, status.st_size  # end exclusive
        asked = self.headers.get("Range")
        if asked:
            match = _RANGE.match(asked.strip())
            if not match or int(match.group(1)) >= status.st_size:
                self.send_error(416)
                return
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1, status.st_size) if match.group(2) else status.st_size
        self.send_response(206 if asked else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{status.st_size:x}-{status.st_mtime_ns:x}"')
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{status.st_size}")
        self.end_headers()
        if body:
            with open(path, "rb") as file:
                file.seek(start)
                self.wfile.write(file.read(end - start))

    def log_message(self, *args) -> None:  # quiet
        pass


class HttpServer:
    """The server above over `folder`, on a free port of 127.0.0.1; `url(name)` is a file's URL."""

    def __init__(self, folder: Path):
        self.folder, self.port = Path(folder), free_port()
        self.process: subprocess.Popen | None = None

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def start(self) -> HttpServer:
        self.process = start_process([sys.executable, __file__, str(self.folder), str(self.port)], self.port)
        return self

    def stop(self) -> None:
        stop_process(self.process)


if __name__ == "__main__":
    RangeHandler.root = Path(sys.argv[1]).resolve()
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), RangeHandler).serve_forever()
