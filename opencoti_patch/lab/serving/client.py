"""One request of the load test, and what it proves: the status, valid JSON (every SSE chunk too), its own
prompt's token count and marker echoed, no other request's marker or key in the answer."""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .http import Transport
from .schedule import KEY_RE, MARKER_RE, Job, LoadConfig

BOS_PREFIXES = ("<bos>", "<s>", "<|begin_of_text|>")


@dataclass
class Outcome:
    pos: int
    key: int
    rid: str
    endpoint: str
    stream: bool
    repeat_of: int | None
    cancel_after: int | None
    fact: str = ""  # the key of its context that the answer should repeat
    status: int | None = None
    errors: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # check names the errors belong to
    skipped: bool = False
    cancelled: bool = False
    content: str = ""
    chunks: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    echo_exact: bool | None = None
    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    cache_n: int | None = None
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.errors

    @property
    def complete(self) -> bool:
        """Finished normally: usable for determinism and cross-variant comparisons."""
        return self.ok and not self.cancelled

    def fail(self, kind: str, message: str) -> None:
        self.kinds.append(kind)
        self.errors.append(message)


def request_body(job: Job, cfg: LoadConfig, cache_prompt: bool = True) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"prompt": job.spec.prompt, "temperature": 0.0, "stream": job.stream,
                              "ignore_eos": True, "seed": cfg.seed, "cache_prompt": cache_prompt}
    if job.endpoint == "v1":
        return "/v1/completions", {"model": "loadtest", "max_tokens": cfg.n_predict, **common}
    return "/completion", {"n_predict": cfg.n_predict, **common}


def _foreign(text: str, own: str, pattern: re.Pattern[str] = MARKER_RE) -> list[str]:
    return sorted({m for m in pattern.findall(text) if m != own})


def _check_content(job: Job, out: Outcome) -> None:
    """The whole answer (a key may span stream chunks): no other request's marker or key."""
    foreign = _foreign(out.content, job.spec.rid) + _foreign(out.content, job.spec.fact, KEY_RE)
    if foreign:
        out.fail("attribution", f"answer holds another request's marker or key: {foreign[:3]}")


def _check_chunk(job: Job, obj: Any, out: Outcome, final: bool) -> tuple[str, bool]:
    """Validate one response object; returns (text, is_final)."""
    if not isinstance(obj, dict):
        out.fail("schema", f"response is {type(obj).__name__}, not an object")
        return "", False
    if "error" in obj:
        out.fail("server_error", f"error object: {json.dumps(obj['error'])[:200]}")
        return "", True
    rid, expect = job.spec.rid, job.spec.n_tokens
    if job.endpoint == "v1":
        try:
            choice = obj["choices"][0]
            text, is_final = choice["text"], choice.get("finish_reason") is not None
        except (KeyError, IndexError, TypeError):
            out.fail("schema", "no choices[0].text")
            return "", False
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("prompt_tokens") != expect:
            out.fail("attribution", f"usage.prompt_tokens {usage.get('prompt_tokens')} != {expect}")
    else:
        text, is_final = obj.get("content"), bool(obj.get("stop"))
        if not isinstance(text, str):
            out.fail("schema", "no content string")
            return "", False
        if obj.get("tokens_evaluated") != expect:
            out.fail("attribution", f"tokens_evaluated {obj.get('tokens_evaluated')} != {expect}")
        echo = obj.get("prompt")
        if is_final and isinstance(echo, str):
            if rid not in echo or _foreign(echo, rid):
                out.fail("attribution", f"echoed prompt lacks {rid} or holds {_foreign(echo, rid)[:3]}")
            stripped = echo
            for bos in BOS_PREFIXES:
                stripped = stripped.removeprefix(bos)
            out.echo_exact = stripped == job.spec.prompt
    if not isinstance(text, str):
        out.fail("schema", "text is not a string")
        return "", is_final
    if is_final or final:
        t = obj.get("timings")
        if isinstance(t, dict):
            out.prompt_n, out.prompt_ms = t.get("prompt_n"), t.get("prompt_ms")
            out.predicted_n, out.predicted_ms = t.get("predicted_n"), t.get("predicted_ms")
            out.cache_n = t.get("cache_n")
    return text, is_final


def _status_check(out: Outcome, status: int, body: bytes) -> bool:
    out.status = status
    if status >= 500:
        out.fail("no_5xx", f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}")
    elif status != 200:
        out.fail("http_status", f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}")
    return status == 200


def run_one(transport: Transport, base_url: str, job: Job, cfg: LoadConfig, timeout: float,
            cache_prompt: bool = True) -> Outcome:
    out = Outcome(pos=job.pos, key=job.spec.key, rid=job.spec.rid, endpoint=job.endpoint, stream=job.stream,
                  repeat_of=job.repeat_of, cancel_after=job.cancel_after, fact=job.spec.fact)
    path, body = request_body(job, cfg, cache_prompt)
    t0 = out.t_start = time.monotonic()
    try:
        if not job.stream:
            status, data = transport.post(base_url + path, body, timeout)
            if _status_check(out, status, data):
                try:
                    obj = json.loads(data)
                except ValueError:
                    out.fail("valid_json", f"invalid JSON body: {data[:200]!r}")
                else:
                    out.content, _ = _check_chunk(job, obj, out, final=True)
        else:
            _run_stream(transport, base_url + path, body, job, out, timeout, t0)
        _check_content(job, out)
    except (OSError, http.client.HTTPException) as exc:
        out.fail("no_transport_errors", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # requests' own exceptions (not OSError subclasses in every version)
        out.fail("no_transport_errors", f"{type(exc).__name__}: {exc}")
    out.t_end = time.monotonic()
    out.latency_s = out.t_end - t0
    return out


def _run_stream(transport: Transport, url: str, body: dict[str, Any], job: Job, out: Outcome,
                timeout: float, t0: float) -> None:
    resp = transport.stream(url, body, timeout)
    try:
        if not _status_check(out, resp.status, resp.body() if resp.status != 200 else b""):
            return
        parts: list[str] = []
        final = done = False
        for raw in resp.lines():
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                out.fail("valid_json", f"SSE line is not UTF-8: {raw[:80]!r}")
                continue
            if not line or line.startswith(":"):
                continue  # event separator / keep-alive ping
            if not line.startswith("data:"):
                kind = "server_error" if line.startswith("error") else "valid_json"
                out.fail(kind, f"unexpected SSE line: {line[:200]}")
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            out.chunks += 1
            try:
                obj = json.loads(payload)
            except ValueError:
                out.fail("valid_json", f"invalid JSON in SSE chunk {out.chunks}: {payload[:200]}")
                continue
            text, is_final = _check_chunk(job, obj, out, final=False)
            if text and out.ttft_s is None:
                out.ttft_s = time.monotonic() - t0
            parts.append(text)
            final = final or is_final
            if final and job.endpoint == "completion":
                break
            if job.cancel_after is not None and not final and out.chunks >= job.cancel_after:
                out.cancelled = True
                break
        out.content = "".join(parts)
        if not out.cancelled and not final and not out.errors:
            out.fail("stream_complete", "stream ended without a final chunk")
        if job.endpoint == "v1" and final and not done and not out.cancelled:
            # read on to the terminator
            for raw in resp.lines():
                if raw.strip() == b"data: [DONE]":
                    done = True
                    break
            if not done:
                out.fail("stream_complete", "no data: [DONE] after the final chunk")
    finally:
        resp.close()
