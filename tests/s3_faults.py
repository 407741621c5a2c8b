"""A fault-injecting HTTP proxy for the object-storage tests (run as its own process by tests/s3_server.py):

    python tests/s3_faults.py PORT UPSTREAM EVERY COUNTER_FILE [DELAY_MS [ranges]]

Every EVERY-th request (none with 0) gets, in turn: 503 SlowDown, 429 Too Many Requests, or a connection
dropped after a partial answer (and each range GET appends "range"). Other requests are forwarded to UPSTREAM unchanged, after DELAY_MS (a distant
store's latency; with `ranges`, only range GETs wait: a store slow to serve data, quick with metadata). Each
injected fault appends its kind to COUNTER_FILE."""

from __future__ import annotations

import http.client
import itertools
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')


def main() -> None:
    port, upstream, every, counter = int(sys.argv[1]), urlsplit(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    delay = float(sys.argv[5]) / 1000 if len(sys.argv) > 5 else 0.0
    only_ranges = len(sys.argv) > 6 and sys.argv[6] == "ranges"
    numbers, lock = itertools.count(1), threading.Lock()
    faults = itertools.cycle(["503", "429", "drop"])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _fault(self) -> str | None:
            with lock:
                if not every or next(numbers) % every:
                    return None
                kind = next(faults)
                with open(counter, "a") as out:
                    out.write(kind + "\n")
                return kind

        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.command == "GET" and self.headers.get("Range"):
                with lock, open(counter, "a") as out:
                    out.write("range\n")  # every range request, to count what a cache saves
            kind = self._fault()
            if kind in ("503", "429"):
                self.send_response(int(kind))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                return
            if not only_ranges or (self.command == "GET" and self.headers.get("Range")):
                time.sleep(delay)
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            connection.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                               headers=headers)
            answer = connection.getresponse()
            payload = answer.read()
            connection.close()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(name, value)
            self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                             else str(len(payload)))
            self.end_headers()
            if kind == "drop":  # half the answer, then the connection goes away
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if self.command != "HEAD":
                self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
