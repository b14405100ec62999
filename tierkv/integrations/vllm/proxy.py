"""The smallest OpenAI-compatible proxy for prefill/decode disaggregation through tierkv: an
example for operators who do not run llm-d or Dynamo, and the tests' proxy; not a router.

For each ``POST /v1/completions`` or ``/v1/chat/completions`` it sends the request to the
prefill engine (``kv_role`` ``kv_producer``) with ``max_tokens=1``, no streaming and
``kv_transfer_params={"do_remote_decode": true}``; then the original request to the decode
engine (``kv_consumer``) with the ``kv_transfer_params`` the prefill answered, and relays that
answer (streamed when asked). Anything else goes to the decode engine as it is. A prefill that
fails is not fatal: the decode engine computes the prompt itself.

    python -m tierkv.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("tierkv.integrations.vllm.proxy")

TWO_STEP_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                          "host", "proxy-connection", "upgrade", "te", "trailer"})


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Where the two engines listen (``http://host:port``), and how long a call may take."""

    prefill_url: str
    decode_url: str
    timeout_s: float = 600.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill engine gets it: one token, not streamed, asking for a
    handoff."""
    prefill = dict(body)
    prefill.update(max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    return prefill


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_GET(self) -> None:
        self._relay(self.server.config.decode_url, "GET", None)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = urllib.parse.urlsplit(self.path).path
        if path not in TWO_STEP_PATHS:
            self._relay(self.server.config.decode_url, "POST", raw)
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            self._answer(400, {"error": {"message": f"bad JSON body: {exc}"}})
            return
        params = self._prefill(body)
        decode = dict(body)
        if params is not None:
            decode["kv_transfer_params"] = params
        self._relay(self.server.config.decode_url, "POST", json.dumps(decode).encode())

    def _prefill(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill engine's ``kv_transfer_params``; None when it failed (the decode
        engine then computes the prompt)."""
        try:
            status, _, data = self._call(self.server.config.prefill_url, "POST",
                                         json.dumps(prefill_body(body)).encode())
            if status != 200:
                log.warning("prefill answered HTTP %d: %s", status, data[:200])
                return None
            params = json.loads(data).get("kv_transfer_params")
            return params if isinstance(params, dict) else None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            log.warning("prefill failed (%s); the decode engine computes the prompt", exc)
            return None

    def _call(self, base_url: str, method: str, data: bytes | None
              ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = self._connect(base_url)
        try:
            connection.request(method, self.path, body=data, headers=self._headers(data))
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def _connect(self, base_url: str) -> http.client.HTTPConnection:
        url = urllib.parse.urlsplit(base_url)
        return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80,
                                          timeout=self.server.config.timeout_s)

    def _headers(self, data: bytes | None) -> dict[str, str]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        if data is not None:
            headers["Content-Type"] = "application/json"
            headers["Content-Length"] = str(len(data))
        return headers

    def _relay(self, base_url: str, method: str, data: bytes | None) -> None:
        """Send the request to ``base_url`` and relay its answer as it comes (chunked)."""
        connection = self._connect(base_url)
        try:
            connection.request(method, self.path, body=data, headers=self._headers(data))
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            self._answer(502, {"error": {"message": f"the decode engine failed: {exc}"}})
            return
        try:
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_HEADERS:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            connection.close()

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ProxyServer(ThreadingHTTPServer):
    """The proxy on ``(host, port)`` (port 0: any free one, ``server_address`` says which);
    one thread per request. ``start`` serves in the background, ``close`` stops."""

    daemon_threads = True

    def __init__(self, config: ProxyConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.config = config
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ProxyServer:
        self._thread = threading.Thread(target=self.serve_forever, name="tierkv-pd-proxy",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill engine, http://host:port")
    parser.add_argument("--decode", required=True, help="the decode engine, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = ProxyServer(ProxyConfig(args.prefill, args.decode, args.timeout_s), args.host,
                         args.port)
    log.info("P/D proxy on %s: prefill %s, decode %s", server.url, args.prefill, args.decode)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
