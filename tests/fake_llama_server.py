"""A tiny stand-in for llama-server (stdlib http.server) for the load-test driver's unit tests.

Mimics /health, /tokenize, /completion and /v1/completions, streamed (SSE) or not. A "token" is a
whitespace-separated word (+1 for BOS). Faults can be switched on to prove the driver's checks fail.
Also runs as a script (``python fake_llama_server.py --port N [ignored llama-server args]``).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MARKER = re.compile(r"LT[0-9a-f]{2}-\d{4}-[0-9a-f]{6}")
KEY = re.compile(r"The key of document (\S+) is (KY[0-9a-f]{2}-\d{4}-[0-9a-f]{6})\.")


@dataclass
class Faults:
    status_500_calls: set[int] = field(default_factory=set)  # 1-based completion calls answered 500
    bad_json_chunk: bool = False  # the 2nd SSE chunk of every stream is not JSON
    leak: bool = False  # outputs carry the previous request's marker (text fed back to another request)
    no_echo: bool = False  # outputs never repeat their context's key (what a model does not asked for it)
    # outputs repeat their own marker (the question names it), then continue the previous request's
    # context instead of their own: the key of their own context is never read
    wrong_context: bool = False
    nondeterministic: bool = False  # outputs depend on a call counter
    salt: str = ""  # changes every output (a "different model")
    health_503: int = 0  # the first N /health calls answer 503 (loading)
    chunk_delay_s: float = 0.0


class FakeLlamaServer:
    def __init__(self, faults: Faults | None = None, port: int = 0) -> None:
        self.faults = faults or Faults()
        self.lock = threading.Lock()
        self.calls = 0
        self.health_calls = 0
        self.last_marker = ""
        self.last_words: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeLlamaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def pieces(self, prompt: str, n: int, call: int) -> list[str]:
        own = MARKER.findall(prompt)
        key = KEY.search(prompt)
        h = hashlib.sha256((prompt + self.faults.salt).encode()).hexdigest()
        if self.faults.nondeterministic:
            h = hashlib.sha256(f"{h}{call}".encode()).hexdigest()
        out = [f" w{h[2 * i : 2 * i + 2]}" for i in range(n)]
        if key and not self.faults.no_echo:
            out[0] = f" {key.group(2)}"  # the prompt asks for its context's key again: a model copies it
        words = [w for w in prompt.split() if not MARKER.search(w) and not w.startswith("KY")]
        with self.lock:
            prev, self.last_marker = self.last_marker, (own[0] if own else "")
            prev_words, self.last_words = self.last_words, words
        if self.faults.leak and prev and n > 1:
            out[1] = f" {prev}"
        if self.faults.wrong_context and own:
            tail = prev_words[len(prev_words) // 2:] or words
            out = [f" {own[0]}", *(f" {w}" for w in tail[: n - 1])]
        return out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
                pass

            def _send(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path == "/health":
                    with srv.lock:
                        srv.health_calls += 1
                        loading = srv.health_calls <= srv.faults.health_503
                    self._send(503 if loading else 200, {"status": "loading" if loading else "ok"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if self.path == "/tokenize":
                    n = len(body["content"].split()) + (1 if body.get("add_special") else 0)
                    self._send(200, {"tokens": list(range(n))})
                    return
                if self.path not in ("/completion", "/v1/completions"):
                    self._send(404, {"error": "not found"})
                    return
                with srv.lock:
                    srv.calls += 1
                    call = srv.calls
                if call in srv.faults.status_500_calls:
                    self._send(500, {"error": {"code": 500, "message": "Failed to parse input at pos 0"}})
                    return
                v1 = self.path == "/v1/completions"
                prompt = body["prompt"]
                n_prompt = len(prompt.split()) + 1
                n = int(body.get("max_tokens" if v1 else "n_predict", 16))
                pieces = srv.pieces(prompt, n, call)
                timings = {
                    "cache_n": 0,
                    "prompt_n": n_prompt,
                    "prompt_ms": 1.0 * n_prompt,
                    "predicted_n": n,
                    "predicted_ms": 2.0 * n,
                }
                if body.get("stream"):
                    self._stream(v1, prompt, n_prompt, pieces, timings)
                elif v1:
                    self._send(
                        200,
                        {
                            "choices": [{"text": "".join(pieces), "index": 0, "finish_reason": "length"}],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n},
                            "timings": timings,
                        },
                    )
                else:
                    self._send(
                        200,
                        {
                            "content": "".join(pieces),
                            "stop": True,
                            "tokens_evaluated": n_prompt,
                            "tokens_predicted": n,
                            "prompt": "<bos>" + prompt,
                            "timings": timings,
                        },
                    )

            def _stream(
                self, v1: bool, prompt: str, n_prompt: int, pieces: list[str], timings: dict[str, Any]
            ) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                events: list[str] = []
                for p in pieces:
                    if v1:
                        events.append(
                            json.dumps({"choices": [{"text": p, "index": 0, "finish_reason": None}]})
                        )
                    else:
                        events.append(json.dumps({"content": p, "stop": False, "tokens_evaluated": n_prompt}))
                if v1:
                    events.append(
                        json.dumps(
                            {
                                "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                                "usage": {"prompt_tokens": n_prompt},
                                "timings": timings,
                            }
                        )
                    )
                else:
                    events.append(
                        json.dumps(
                            {
                                "content": "",
                                "stop": True,
                                "tokens_evaluated": n_prompt,
                                "prompt": "<bos>" + prompt,
                                "timings": timings,
                            }
                        )
                    )
                if srv.faults.bad_json_chunk and len(events) > 1:
                    events[1] = events[1][:-7]  # truncated: not JSON
                try:
                    self.wfile.write(b": ping\n\n")
                    for e in events:
                        self.wfile.write(f"data: {e}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(srv.faults.chunk_delay_s)
                    if v1:
                        self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client cancelled

        return Handler


def main(argv: list[str]) -> None:
    port = int(argv[argv.index("--port") + 1])
    srv = FakeLlamaServer(port=port)
    srv.httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
