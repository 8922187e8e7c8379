"""The HTTP clients of the serving tools: ``requests`` where it is installed, else ``http.client``, behind one
:class:`Transport` (GET, POST, a streamed POST read line by line)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any, Protocol

from ...errors import OpencotiError


class StreamResponse(Protocol):
    status: int

    def lines(self) -> Iterator[bytes]: ...

    def body(self) -> bytes: ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    def get(self, url: str, timeout: float) -> tuple[int, bytes]: ...

    def post(self, url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]: ...

    def stream(self, url: str, body: dict[str, Any], timeout: float) -> StreamResponse: ...


class _HttpClientStream:
    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self._conn, self._resp, self.status = conn, resp, resp.status

    def lines(self) -> Iterator[bytes]:
        while True:
            line = self._resp.readline()
            if not line:
                return
            yield line.rstrip(b"\r\n")

    def body(self) -> bytes:
        return self._resp.read()

    def close(self) -> None:
        self._conn.close()


class HttpClientTransport:
    """``http.client`` (always available)."""

    name = "http.client"

    @staticmethod
    def _open(method: str, url: str, body: dict[str, Any] | None,
              timeout: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        u = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, u.path or "/", body=data, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        conn, resp = self._open("GET", url, None, timeout)
        try:
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]:
        conn, resp = self._open("POST", url, body, timeout)
        try:
            return resp.status, resp.read()
        finally:
            conn.close()

    def stream(self, url: str, body: dict[str, Any], timeout: float) -> StreamResponse:
        conn, resp = self._open("POST", url, body, timeout)
        return _HttpClientStream(conn, resp)


class _RequestsStream:
    def __init__(self, resp: Any) -> None:
        self._resp, self.status = resp, int(resp.status_code)

    def lines(self) -> Iterator[bytes]:
        # iter_lines() splits on \r too and may join pieces; SSE lines from llama-server are \n-separated
        yield from self._resp.iter_lines(chunk_size=None)

    def body(self) -> bytes:
        return bytes(self._resp.content)

    def close(self) -> None:
        self._resp.close()


class RequestsTransport:
    """``requests`` (one connection per request, as concurrent clients would do)."""

    name = "requests"

    def __init__(self) -> None:
        import requests  # noqa: PLC0415 - optional dependency

        self._rq = requests

    def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        r = self._rq.get(url, timeout=timeout)
        return int(r.status_code), bytes(r.content)

    def post(self, url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]:
        r = self._rq.post(url, json=body, timeout=timeout)
        return int(r.status_code), bytes(r.content)

    def stream(self, url: str, body: dict[str, Any], timeout: float) -> StreamResponse:
        return _RequestsStream(self._rq.post(url, json=body, timeout=timeout, stream=True))


def default_transport(name: str = "auto") -> Transport:
    if name == "http.client":
        return HttpClientTransport()
    try:
        return RequestsTransport()
    except ImportError:
        if name == "requests":
            raise OpencotiError("the requests package is not installed") from None
        return HttpClientTransport()


def get_json(transport: Transport, url: str, timeout: float = 30.0) -> Any:
    status, data = transport.get(url, timeout)
    if status != 200:
        raise OpencotiError(f"GET {url}: HTTP {status}: {data[:200]!r}")
    return json.loads(data)
