"""Bounded serving load test of llama-server (dense vs sparse attention).

Starts llama-server (loopback, a free port, ``--parallel 4 -fa on`` + per-variant args such as
``--sparse-attn on --sparse-attn-topk 8``), waits for ``/health``, then sends a fixed, seeded
schedule of long-prompt requests from a thread pool: a mix of ``/completion`` and
``/v1/completions``, streamed (SSE) and not, some streams closed after a few chunks (cancelled), a
subset of prompts sent twice at different positions. Every prompt is a different slice of a real
text corpus carrying a unique marker, and in the middle of that slice a unique key ("The key of document
<marker> is <key>."), so each output can be attributed to its request and to its own context.

Checks (each a :class:`..verdict.Check`: pass, FAIL or "not checked"; the verdict through ``verdict_of``):
- ``no_5xx`` / ``no_transport_errors``: every request answered, none with a 5xx.
- ``valid_json``: every non-streamed body and every SSE ``data:`` chunk parses as JSON.
- ``attribution``: ``tokens_evaluated`` / ``usage.prompt_tokens`` equal the prompt's own token count,
  the echoed ``prompt`` holds the request's own marker and no other, no output holds a foreign marker
  (a request's text fed back as another's input shows up here).
- ``key_echo``: every prompt ends by asking for the key placed in the middle of its own context ("The
  key of document <marker> is"), so a real model copies it into the answer: at least ``--min-key-echo``
  of the finished answers must hold their own key. An answer can only do so by reading its own context:
  one that repeats its own marker (which the question holds) but continues another request's context
  fails here, and one that holds another request's key fails ``attribution``. Without it the foreign
  checks could never fire (answers that hold no key prove nothing about slots mixing); ``--min-key-echo
  0`` (a random-weight model) makes it "not checked".
- ``isolated_deterministic``: after the load, ``--isolated`` prompts are re-sent one at a time with the
  prompt cache off (the first one twice); at temperature 0 they must repeat exactly. Under load a
  repeated prompt (sent twice at different positions, streamed or not) is compared too, but only
  reported (``--strict-load-determinism`` makes it a check): llama-server is not batch-invariant
  (with ``--parallel`` > 1 a prompt's ubatches are cut differently depending on which other slots are
  busy, and CPU FA / matmul round differently for other ubatch shapes), dense included.
- ``rss_flat``: the server's RSS (``/proc/<pid>/status``), sampled throughout the load (a timer, and
  once when the warm-up requests are done: the baseline), peaks at most a threshold above the baseline
  (the peak, not the last sample). Fewer than :data:`MIN_MEMORY_SAMPLES` samples from the baseline to the
  end (e.g. only a start and an end sample) prove nothing: "not checked".
- ``gpu_mem_flat``: the same for the server's GPU memory (``nvidia-smi --query-compute-apps``); "not
  checked" where nvidia-smi lists no memory for the server (no GPU, no nvidia-smi).
  Neither can be measured without the server's pid (``--url`` without ``--server-pid``): "not checked".
  A check not checked makes the verdict INCOMPLETE (exit 4) unless ``--accept-not-checked CHECK`` names it
  (bare: any).
- ``server_alive``: the server still answers ``/health`` after the run and did not exit.
- ``--expect-equal A:B``: two variants give identical text on the isolated reference (e.g. sparse
  select-all vs dense); their agreement under load is reported beside it.

Standard library only; uses ``requests`` when it is installed, else ``http.client`` (the GPU hosts
may lack ``requests``). Runnable without the rest of the CLI: ``python3 -m opencoti_patch.quality.loadtest``.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..config import Settings, write_report  # standard library only, like this module
from ..errors import EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK
from ..verdict import Check, Verdict, verdict_of

DEFAULT_CORPUS = "<tree>/docs/**/*.md"  # the vendored tree's docs (opencoti_patch.config.Settings)
MARKER_RE = re.compile(r"LT[0-9a-f]{2}-\d{4}-[0-9a-f]{6}")
KEY_RE = re.compile(r"KY[0-9a-f]{2}-\d{4}-[0-9a-f]{6}")  # the per-request key placed inside the context
MIN_MEMORY_SAMPLES = 3  # from the post-warm-up baseline to the end: baseline, >= 1 during the load, end
# every check of a variant, one stage each (accepted by name when not checked)
STAGES = ("all_started", "no_5xx", "no_transport_errors", "valid_json", "no_server_errors", "attribution",
          "key_echo", "isolated_ok", "isolated_deterministic", "rss_flat", "gpu_mem_flat", "server_alive")
BOS_PREFIXES = ("<bos>", "<s>", "<|begin_of_text|>")


class LoadTestError(Exception):
    """Setup failure (no server, no corpus, bad arguments): exit code 1."""


# --- configuration ----------------------------------------------------------------------------------


@dataclass
class LoadConfig:
    requests: int = 200
    concurrency: int = 6
    min_tokens: int = 1024
    max_tokens: int = 4096
    shared_prefix_tokens: int = 0  # a common prefix (cached by the server) in front of some slices
    shared_prefix_frac: float = 0.5  # the share of prompts with that prefix (the rest start cold)
    n_predict: int = 16
    seed: int = 0
    stream_frac: float = 0.5
    cancel_frac: float = 0.2  # of the streamed requests
    cancel_chunks: tuple[int, int] = (1, 4)
    v1_frac: float = 0.3  # share sent to /v1/completions (the rest to /completion)
    repeat_frac: float = 0.1
    time_limit_s: float = 900.0  # per server run: no request starts after it
    request_timeout_s: float = 600.0
    rss_interval_s: float = 0.5
    warmup_frac: float = 0.1
    rss_growth_mib: float = 64.0
    gpu_growth_mib: float = 64.0
    min_key_echo: float = 0.9  # share of finished answers that must hold their own context's key
    isolated: int = 4  # prompts re-sent one at a time, uncached, after the load (batch-invariant reference)
    strict_load_determinism: bool = False  # llama-server is not batch-invariant: see module doc

    def validate(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.n_predict < 1:
            raise LoadTestError("requests, concurrency and n_predict must be >= 1")
        if not 0 < self.min_tokens <= self.max_tokens:
            raise LoadTestError(f"need 0 < min-tokens <= max-tokens, "
                                f"got {self.min_tokens}..{self.max_tokens}")
        if self.shared_prefix_tokens and self.shared_prefix_tokens + 64 > self.min_tokens:
            raise LoadTestError("shared-prefix-tokens must leave >= 64 tokens of min-tokens for the slice")
        for name in ("stream_frac", "cancel_frac", "v1_frac", "repeat_frac", "warmup_frac",
                     "shared_prefix_frac", "min_key_echo"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise LoadTestError(f"{name} must be in [0, 1]")
        if self.repeat_frac > 0.5:
            raise LoadTestError("repeat-frac must be <= 0.5")


@dataclass
class ServerConfig:
    binary: Path
    model: Path
    args: list[str] = field(default_factory=list)  # variant + extra args, passed through
    parallel: int = 4
    ctx: int = 4 * 4096
    threads: int | None = None
    cache_ram_mib: int = 0  # the RAM prompt cache grows by design: off so that RSS must stay flat
    startup_timeout_s: float = 600.0
    log_path: Path | None = None

    def command(self, port: int) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(self.parallel), "-fa", "on", "-c", str(self.ctx),
               "--cache-ram", str(self.cache_ram_mib)]
        if self.threads is not None:
            cmd += ["-t", str(self.threads)]
        return cmd + list(self.args)


@dataclass
class Spec:
    """One prompt (repeats share the prompt of their original)."""

    key: int  # index of the unique prompt
    rid: str  # its marker
    prompt: str
    n_tokens: int  # with BOS, as the server counts tokens_evaluated
    fact: str = ""  # the key placed in the middle of its context, which the answer must repeat


@dataclass
class Job:
    pos: int  # position in the schedule
    spec: Spec
    endpoint: str  # "completion" | "v1"
    stream: bool
    cancel_after: int | None = None  # close a stream after this many data chunks
    repeat_of: int | None = None  # schedule position of the original


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


# --- HTTP transports ----------------------------------------------------------------------------------


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
            raise LoadTestError("the requests package is not installed") from None
        return HttpClientTransport()


def get_json(transport: Transport, url: str, timeout: float = 30.0) -> Any:
    status, data = transport.get(url, timeout)
    if status != 200:
        raise LoadTestError(f"GET {url}: HTTP {status}: {data[:200]!r}")
    return json.loads(data)


# --- corpus and prompts -----------------------------------------------------------------------------


def load_corpus(patterns: Sequence[str], min_chars: int = 20000) -> str:
    files: list[str] = []
    for pattern in patterns:
        files += sorted(glob.glob(pattern, recursive=True))
    texts = []
    for f in dict.fromkeys(files):
        try:
            texts.append(Path(f).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    corpus = "\n\n".join(t for t in texts if t.strip())
    if len(corpus) < min_chars:
        raise LoadTestError(f"corpus from {list(patterns)} has {len(corpus)} chars, need >= {min_chars}")
    # no marker- or key-like strings in the corpus itself (they would read as foreign ones)
    return KEY_RE.sub("KY--", MARKER_RE.sub("LT--", corpus))


def marker(seed: int, key: int, rng: random.Random) -> str:
    return f"LT{seed % 256:02x}-{key:04d}-{rng.getrandbits(24):06x}"


def context_key(seed: int, key: int, rng: random.Random) -> str:
    return f"KY{seed % 256:02x}-{key:04d}-{rng.getrandbits(24):06x}"


def _frame(rid: str, fact: str, body: str) -> tuple[str, str]:
    """(head with the body, tail): the key sentence is a paragraph in the middle of the body, and the
    last lines ask for it, ending in the same words, so a model copies the key from its own context
    (key_echo; Gemma 3 270M: 32 of 32 answers on 128-384-token prompts of docs/usage.md)."""
    cut = body.rfind("\n", 0, len(body) // 2) + 1 or len(body) // 2
    middle = f"\n\nThe key of document {rid} is {fact}.\n\n"
    return (f"\n\n=== document {rid} ===\n{body[:cut]}{middle}{body[cut:]}",
            f"\n=== end of document {rid} ===\nQuestion: What is the key of document {rid}?\n"
            f"Answer: The key of document {rid} is")


def _fit(make: Callable[[int], str], target: int, tokenize: Callable[[str], int], chars0: int,
         lo: int, hi: int) -> tuple[str, int]:
    """Find a char count whose prompt tokenizes to ~target tokens, within [lo, hi]."""
    chars = max(1, chars0)
    best: tuple[str, int] | None = None
    for _ in range(6):
        text = make(chars)
        n = tokenize(text)
        if lo <= n <= hi and (best is None or abs(n - target) < abs(best[1] - target)):
            best = (text, n)
        if abs(n - target) <= max(4, target // 200):
            break
        chars = max(1, int(chars * target / max(n, 1)))
    if best is None:  # shrink/grow until inside the bounds
        for _ in range(40):
            text = make(chars)
            n = tokenize(text)
            if lo <= n <= hi:
                return text, n
            chars = max(1, int(chars * (0.97 if n > hi else 1.03)))
        raise LoadTestError(f"could not fit a prompt of {target} tokens within [{lo}, {hi}]")
    return best


def build_specs(corpus: str, cfg: LoadConfig, n_unique: int,
                tokenize: Callable[[str], int]) -> list[Spec]:
    """Seeded prompts: token lengths uniform in [min, max], each a different corpus slice + marker."""
    rng = random.Random(cfg.seed)
    ratio = 3.5  # chars per token, refined by the tokenizer
    big = corpus
    while len(big) < 8 * cfg.max_tokens + 1000:
        big += "\n\n" + corpus
    prefix = ""
    if cfg.shared_prefix_tokens:
        p = cfg.shared_prefix_tokens
        prefix, _ = _fit(lambda c: big[:c], p, tokenize, int(p * ratio), p - max(8, p // 50), p)
    specs: list[Spec] = []
    offsets = rng.sample(range(0, len(big) - 6 * cfg.max_tokens), n_unique)
    for key in range(n_unique):
        target = rng.randint(cfg.min_tokens, cfg.max_tokens)
        rid = marker(cfg.seed, key, rng)
        fact = context_key(cfg.seed, key, rng)
        off = offsets[key]
        # only some prompts share the cached prefix: the others start cold, in the same batches (the first
        # two prompts one of each, so that both kinds exist for any 0 < frac < 1)
        first = {0: 0.0, 1: 1.0}.get(key, rng.random()) if 0 < cfg.shared_prefix_frac < 1 else rng.random()
        pre = prefix if first < cfg.shared_prefix_frac else ""
        n_pre = cfg.shared_prefix_tokens if pre else 0

        def make(chars: int, off: int = off, rid: str = rid, fact: str = fact, pre: str = pre) -> str:
            head, tail = _frame(rid, fact, big[off:off + chars])
            return pre + head + tail

        text, n = _fit(make, target, tokenize, int((target - n_pre) * ratio), cfg.min_tokens, cfg.max_tokens)
        ratio = max(1.0, len(text) / n)
        specs.append(Spec(key=key, rid=rid, prompt=text, n_tokens=n, fact=fact))
    return specs


def schedule(specs: Sequence[Spec], cfg: LoadConfig) -> list[Job]:
    """Seeded request order: endpoints, streaming, cancellations and repeats."""
    rng = random.Random(cfg.seed + 1)
    jobs: list[Job] = []
    for spec in specs:
        stream = rng.random() < cfg.stream_frac
        cancel = rng.randint(*cfg.cancel_chunks) if stream and rng.random() < cfg.cancel_frac else None
        endpoint = "v1" if rng.random() < cfg.v1_frac else "completion"
        jobs.append(Job(pos=len(jobs), spec=spec, endpoint=endpoint, stream=stream, cancel_after=cancel))
    n_rep = cfg.requests - len(specs)
    gap = max(1, min(2 * cfg.concurrency + 1, len(jobs) // 3))  # a different batch for the repeat
    candidates = [j for j in jobs if j.cancel_after is None and j.pos + gap < len(jobs)]
    if n_rep > len(candidates):
        raise LoadTestError(f"not enough prompts to repeat {n_rep} of them")
    order: list[Job] = list(jobs)
    for i, orig in enumerate(sorted(rng.sample(candidates, n_rep), key=lambda j: j.pos)):
        at = order.index(orig)
        where = rng.randint(min(at + gap, len(order)), len(order))
        stream = (not orig.stream) if i % 2 == 0 else orig.stream  # half also check stream == non-stream
        order.insert(where, Job(pos=-1, spec=orig.spec, endpoint=orig.endpoint, stream=stream,
                                repeat_of=orig.pos))
    # renumber positions; repeat_of refers to the original's final position
    old_to_new: dict[int, int] = {}
    for i, job in enumerate(order):
        if job.repeat_of is None:
            old_to_new[job.pos] = i
    for i, job in enumerate(order):
        job.pos = i
        if job.repeat_of is not None:
            job.repeat_of = old_to_new[job.repeat_of]
    return order


def plan(corpus: str, cfg: LoadConfig, tokenize: Callable[[str], int]) -> list[Job]:
    cfg.validate()
    n_unique = cfg.requests - int(round(cfg.requests * cfg.repeat_frac))
    return schedule(build_specs(corpus, cfg, n_unique, tokenize), cfg)


def server_tokenizer(transport: Transport, base_url: str) -> Callable[[str], int]:
    def tokenize(text: str) -> int:
        status, data = transport.post(base_url + "/tokenize", {"content": text, "add_special": True}, 120.0)
        if status != 200:
            raise LoadTestError(f"/tokenize: HTTP {status}")
        return len(json.loads(data)["tokens"])

    return tokenize


# --- one request ------------------------------------------------------------------------------------


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


# --- the load -----------------------------------------------------------------------------------------


def nvidia_smi_mib(pid: int) -> int | None:
    """GPU memory (MiB) nvidia-smi lists for ``pid``; None without nvidia-smi or when it lists no such pid."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1])
    return None


class RssSampler:
    """Samples VmRSS of a pid (and how many requests were done at that time) in a thread, and on demand
    (:meth:`sample`: the load samples after every request); with ``gpu`` (pid -> MiB or None, e.g.
    :func:`nvidia_smi_mib`) its GPU memory too."""

    def __init__(self, pid: int | None, interval_s: float, done: Callable[[], int],
                 gpu: Callable[[int], int | None] | None = None) -> None:
        self.pid, self.interval_s, self._done, self._gpu = pid, interval_s, done, gpu
        self.samples: list[tuple[float, int, int]] = []  # (t, rss KiB, requests done)
        self.gpu_samples: list[tuple[float, int, int]] = []  # (t, GPU memory KiB, requests done)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def read_rss_kib(pid: int) -> int | None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return None

    def sample(self, gpu_too: bool = True) -> None:
        """One sample of the RSS, and of the GPU memory unless ``gpu_too`` is False (nvidia-smi is slow)."""
        if self.pid is None:
            return
        rss = self.read_rss_kib(self.pid)
        if rss is not None:
            self.samples.append((time.monotonic(), rss, self._done()))
        gpu = self._gpu(self.pid) if self._gpu is not None and gpu_too else None
        if gpu is not None:
            self.gpu_samples.append((time.monotonic(), gpu * 1024, self._done()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def rss_summary(samples: Sequence[tuple[float, int, int]], warmup_done: int) -> dict[str, Any] | None:
    """Memory samples (t, KiB, requests done) judged from the post-warm-up baseline (the first sample with
    ``warmup_done`` requests done) to the peak after it; with fewer than :data:`MIN_MEMORY_SAMPLES` samples
    from the baseline to the end there is no baseline to judge from (``problem`` says why)."""
    if not samples:
        return None
    mib = [s[1] / 1024.0 for s in samples]
    warm_i = next((i for i, s in enumerate(samples) if s[2] >= warmup_done), len(samples))
    after = mib[warm_i:]
    out: dict[str, Any] = {"samples": len(samples), "after_warmup": len(after), "start_mib": round(mib[0], 1),
                           "peak_mib": round(max(mib), 1), "end_mib": round(mib[-1], 1)}
    if len(after) < MIN_MEMORY_SAMPLES:
        return out | {"problem": f"{len(after)} sample(s) from the post-warm-up baseline to the end, "
                                 f"at least {MIN_MEMORY_SAMPLES} needed ({len(samples)} in all)"}
    warm = mib[warm_i]
    return out | {"warm_mib": round(warm, 1), "growth_after_warmup_mib": round(mib[-1] - warm, 1),
                  "peak_after_warmup_mib": round(max(after) - warm, 1)}


def run_load(transport: Transport, base_url: str, jobs: Sequence[Job], cfg: LoadConfig,
             pid: int | None = None, progress: Callable[[str], None] | None = None,
             gpu: Callable[[int], int | None] | None = nvidia_smi_mib) -> dict[str, Any]:
    """Send the schedule with `cfg.concurrency` client threads; returns outcomes + RSS samples."""
    lock = threading.Lock()
    done = [0]
    t_begin = time.monotonic()
    deadline = t_begin + cfg.time_limit_s
    warmup_done = int(round(len(jobs) * cfg.warmup_frac))
    sampler = RssSampler(pid, cfg.rss_interval_s, lambda: done[0], gpu)

    def work(job: Job) -> Outcome:
        now = time.monotonic()
        if now >= deadline:
            return Outcome(pos=job.pos, key=job.spec.key, rid=job.spec.rid, endpoint=job.endpoint,
                           stream=job.stream, repeat_of=job.repeat_of, cancel_after=job.cancel_after,
                           fact=job.spec.fact, skipped=True)
        timeout = max(10.0, min(cfg.request_timeout_s, deadline - now + cfg.request_timeout_s / 4))
        out = run_one(transport, base_url, job, cfg, timeout)
        with lock:
            done[0] += 1
            n = done[0]
        # the RSS after every request (a /proc read), the GPU memory on the timer and at the warm-up baseline
        sampler.sample(gpu_too=n == warmup_done)
        if progress and (n % max(1, len(jobs) // 20) == 0 or out.errors):
            tail = f" ERR {out.errors[0][:120]}" if out.errors else ""
            progress(f"  {n}/{len(jobs)} done, {time.monotonic() - t_begin:.0f}s{tail}")
        return out

    with sampler:
        with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
            outcomes = list(pool.map(work, jobs))
    return {"outcomes": outcomes, "wall_s": time.monotonic() - t_begin, "rss_samples": sampler.samples,
            "gpu_samples": sampler.gpu_samples, "pid": pid}


def isolated_jobs(jobs: Sequence[Job], n: int) -> list[Job]:
    """`n` prompts spread over the length range (same for every variant), the first one twice."""
    specs = sorted({j.spec.key: j.spec for j in jobs}.values(), key=lambda s: (s.n_tokens, s.key))
    if n <= 0 or not specs:
        return []
    picks = [specs[round(i * (len(specs) - 1) / max(1, n - 1))] for i in range(min(n, len(specs)))]
    picks = list({s.key: s for s in picks}.values()) + [picks[0]]
    last = len(picks) - 1
    return [Job(pos=i, spec=s, endpoint="completion", stream=False, repeat_of=0 if i == last else None)
            for i, s in enumerate(picks)]


def run_isolated(transport: Transport, base_url: str, jobs: Sequence[Job], cfg: LoadConfig) -> list[Outcome]:
    """One request at a time, prompt cache off: the output no longer depends on batch composition."""
    return [run_one(transport, base_url, j, cfg, cfg.request_timeout_s, cache_prompt=False)
            for j in isolated_jobs(jobs, cfg.isolated)]


# --- evaluation ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def determinism(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    by_pos = {o.pos: o for o in outcomes}
    pairs, mismatches = 0, []
    for o in outcomes:
        if o.repeat_of is None or not o.complete or not by_pos[o.repeat_of].complete:
            continue
        orig = by_pos[o.repeat_of]
        pairs += 1
        if o.content != orig.content:
            mismatches.append({"rid": o.rid, "pos": [orig.pos, o.pos], "stream": [orig.stream, o.stream],
                               "cache_n": [orig.cache_n, o.cache_n],
                               "first_diff": _first_diff(o.content, orig.content),
                               "a": orig.content[:200], "b": o.content[:200]})
    return {"pairs": pairs, "mismatches": len(mismatches), "examples": mismatches[:5]}


def compare(a: Sequence[Outcome], b: Sequence[Outcome]) -> dict[str, Any]:
    """Same schedule on two servers: identical text for every request both completed?"""
    bmap = {o.pos: o for o in b}
    both = [(x, bmap[x.pos]) for x in a if x.pos in bmap and x.complete and bmap[x.pos].complete]
    diff = [(x, y) for x, y in both if x.content != y.content]
    return {"compared": len(both), "identical": len(both) - len(diff), "different": len(diff),
            "examples": [{"rid": x.rid, "pos": x.pos, "first_diff": _first_diff(x.content, y.content),
                          "a": x.content[:200], "b": y.content[:200]} for x, y in diff[:5]]}


def summarize(name: str, run: dict[str, Any], cfg: LoadConfig, server: dict[str, Any]) -> dict[str, Any]:
    iso: list[Outcome] = run.get("isolated", [])
    iso_det = determinism(iso)
    outs: list[Outcome] = run["outcomes"]
    started = [o for o in outs if not o.skipped]
    complete = [o for o in outs if o.complete]
    kinds = error_kinds(outs)
    lat = [o.latency_s for o in complete]
    ttft = [o.ttft_s for o in complete if o.ttft_s is not None]
    timed = [o for o in complete if o.predicted_n and o.predicted_ms]
    ptimed = [o for o in complete if o.prompt_n and o.prompt_ms]
    gen_tokens = sum(o.predicted_n or 0 for o in complete)
    warmup_done = int(round(len(outs) * cfg.warmup_frac))
    rss = rss_summary(run["rss_samples"], warmup_done)
    gpu = rss_summary(run.get("gpu_samples", []), warmup_done)
    det = determinism(outs)
    echoed, answered = key_echo(outs)
    checks = variant_checks(name, run, cfg, server, rss, gpu)
    verdict = verdict_of(checks, STAGES)
    return {
        "name": name,
        "server": server,
        "requests": len(outs), "started": len(started), "skipped": len(outs) - len(started),
        "completed": len(complete), "cancelled": sum(o.cancelled for o in outs),
        "streamed": sum(o.stream for o in outs), "v1": sum(o.endpoint == "v1" for o in outs),
        "repeats": sum(o.repeat_of is not None for o in outs),
        "with_errors": sum(bool(o.errors) for o in outs), "error_kinds": kinds,
        "http_5xx": sum(1 for o in outs if o.status is not None and o.status >= 500),
        "echo_exact": f"{sum(o.echo_exact is True for o in outs)}/"
                      f"{sum(o.echo_exact is not None for o in outs)}",
        "wall_s": round(run["wall_s"], 1),
        "latency_p50_s": _r(percentile(lat, 50)), "latency_p99_s": _r(percentile(lat, 99)),
        "ttft_p50_s": _r(percentile(ttft, 50)),
        "prompt_tokens": sum(o.prompt_n or 0 for o in complete),
        "cached_tokens": sum(o.cache_n or 0 for o in complete),
        "generated_tokens": gen_tokens,
        "decode_tps_per_request": _r(sum(o.predicted_n or 0 for o in timed)
                                     / max(1e-9, sum(o.predicted_ms or 0 for o in timed) / 1000.0)),
        "prompt_tps_per_request": _r(sum(o.prompt_n or 0 for o in ptimed)
                                     / max(1e-9, sum(o.prompt_ms or 0 for o in ptimed) / 1000.0)),
        "generated_tps_aggregate": _r(gen_tokens / max(1e-9, run["wall_s"])),
        "key_echo": f"{echoed}/{answered}",
        "rss": rss, "gpu": gpu, "determinism": det, "isolated": {"requests": len(iso), "determinism": iso_det,
                                                      "errors": [o.errors[:2] for o in iso if o.errors]},
        "errors_sample": [{"pos": o.pos, "rid": o.rid, "errors": o.errors[:3]}
                          for o in outs if o.errors][:10],
        "checks": [c.as_dict() for c in checks], "not_checked": list(verdict.not_checked),
        "verdict": verdict.verdict, "passed": not verdict.failed,
    }


def _judged(name: str, stage: str, ok: bool | None, summary: str) -> Check:
    return Check(f"{name}: {stage}", stage, ok, summary if ok is not None else f"not checked: {summary}")


def _memory_check(name: str, stage: str, mem: dict[str, Any] | None, limit: float, missing: str) -> Check:
    if mem is None:
        return _judged(name, stage, None, missing)
    if "problem" in mem:
        return _judged(name, stage, None, mem["problem"])
    grew = mem["peak_after_warmup_mib"]
    return _judged(name, stage, grew <= limit, f"peak {grew} MiB above the post-warm-up baseline "
                   f"{mem['warm_mib']} MiB (limit {limit:g}; {mem['after_warmup']} samples after warm-up)")


def error_kinds(outs: Sequence[Outcome]) -> dict[str, int]:
    """Check name -> how many requests have an error of it."""
    kinds: dict[str, int] = {}
    for o in outs:
        for k in dict.fromkeys(o.kinds):
            kinds[k] = kinds.get(k, 0) + 1
    return kinds


def key_echo(outs: Sequence[Outcome]) -> tuple[int, int]:
    """(finished answers holding the key of their own context, finished answers)."""
    answered = [o for o in outs if o.complete and o.content]
    return sum(bool(o.fact) and o.fact in o.content for o in answered), len(answered)


def variant_checks(name: str, run: dict[str, Any], cfg: LoadConfig, server: dict[str, Any],
                   rss: dict[str, Any] | None, gpu: dict[str, Any] | None) -> list[Check]:
    """The checks of one variant's run, one per stage of :data:`STAGES` (+ strict load determinism)."""
    outs: list[Outcome] = run["outcomes"]
    iso: list[Outcome] = run.get("isolated", [])
    kinds = error_kinds(outs)
    echoed, answered = key_echo(outs)

    def none_of(stage: str, *ks: str) -> Check:
        n = sum(kinds.get(k, 0) for k in ks)
        return _judged(name, stage, n == 0, f"{n} request(s) with {' / '.join(ks)} errors")

    def repeats(stage: str, det: dict[str, Any], what: str) -> Check:
        if not det["pairs"]:
            return _judged(name, stage, None, f"no repeated {what} finished")
        return _judged(name, stage, det["mismatches"] == 0,
                       f"{det['mismatches']} of {det['pairs']} repeated {what}s differ")

    started = sum(not o.skipped for o in outs)
    checks = [_judged(name, "all_started", started == len(outs) and bool(outs),
                      f"{started}/{len(outs)} requests started (before the time limit)"),
              none_of("no_5xx", "no_5xx"), none_of("no_transport_errors", "no_transport_errors"),
              none_of("valid_json", "valid_json"),
              none_of("no_server_errors", "server_error", "http_status", "schema", "stream_complete")]
    attribution = none_of("attribution", "attribution")
    checks.append(attribution if answered or not attribution.passed
                  else _judged(name, "attribution", None, "no finished answer to attribute"))
    # an answer can only repeat its key by reading its own context: without it the foreign checks are blind
    if cfg.min_key_echo <= 0 or not answered:
        checks.append(_judged(name, "key_echo", None, f"--min-key-echo 0 ({echoed}/{answered} echoed)"
                              if answered else "no finished answer"))
    else:
        checks.append(_judged(name, "key_echo", echoed >= cfg.min_key_echo * answered,
                              f"{echoed}/{answered} answers repeat the key of their own context "
                              f"(at least {cfg.min_key_echo:.0%})"))
    checks.append(_judged(name, "isolated_ok", all(o.complete for o in iso) if iso else None,
                          f"{sum(o.complete for o in iso)}/{len(iso)} isolated requests complete" if iso
                          else "no isolated reference (--isolated 0)"))
    checks.append(repeats("isolated_deterministic", determinism(iso), "isolated prompt"))
    if cfg.strict_load_determinism:
        checks.append(repeats("deterministic_under_load", determinism(outs), "prompt under load"))
    pid = run.get("pid")
    no_pid = "no server pid to sample (--url without --server-pid)"
    checks.append(_memory_check(name, "rss_flat", rss, cfg.rss_growth_mib, no_pid))
    checks.append(_memory_check(name, "gpu_mem_flat", gpu, cfg.gpu_growth_mib, no_pid if pid is None else
                                f"nvidia-smi lists no GPU memory for pid {pid} (no GPU, or no nvidia-smi)"))
    alive = bool(server.get("alive_after", True))
    checks.append(_judged(name, "server_alive", alive, "the server answers /health after the run" if alive
                          else f"the server died (exit {server.get('exit_code')})"))
    return checks


def overall_verdict(result: dict[str, Any]) -> tuple[Verdict, list[Check]]:
    """Every variant's checks and every --expect-equal comparison, through ``verdict_of``."""
    checks = [Check(**{k: v for k, v in c.items() if k != "status"}) for x in result["summaries"]
              for c in x["checks"]]
    checks += [Check(f"{c['a']} = {c['b']}", "expect_equal", c["passed"],
                     f"isolated {c['isolated']['identical']}/{c['isolated']['compared']} identical, "
                     f"under load {c['load']['identical']}/{c['load']['compared']}")
               for c in result.get("comparisons", []) if c["required"]]
    return verdict_of(checks, STAGES), checks


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


# --- the server process ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """llama-server on 127.0.0.1 and a free port; ready once /health answers 200."""

    def __init__(self, cfg: ServerConfig, transport: Transport) -> None:
        self.cfg, self.transport = cfg, transport
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.cmd: list[str] = []
        self._log: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _attempt in range(3):
            self.port = free_port()
            self.cmd = self.cfg.command(self.port)
            log = self.cfg.log_path
            self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
            self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            if self._wait_ready():
                return
            code = self.proc.poll()
            self.stop()
            if code is None:
                raise LoadTestError(f"llama-server not healthy after {self.cfg.startup_timeout_s:.0f}s: "
                                    f"{shlex.join(self.cmd)}")
            if "bind" not in self.log_tail().lower():
                raise LoadTestError(f"llama-server exited with {code}: {self.log_tail()[-600:]}")
        raise LoadTestError("llama-server could not bind a free port three times")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        end = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                status, _ = self.transport.get(self.base_url + "/health", 5.0)
                if status == 200:
                    return True
            except Exception:  # connection refused while it loads
                pass
            time.sleep(0.25)
        return False

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return self.transport.get(self.base_url + "/health", 30.0)[0] == 200
        except Exception:
            return False

    def log_tail(self, n: int = 4000) -> str:
        if not self.cfg.log_path or not self.cfg.log_path.exists():
            return ""
        return self.cfg.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(30)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        return code


# --- orchestration ------------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    args: list[str]


def parse_variant(text: str) -> Variant:
    name, sep, args = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise LoadTestError(f"variant must be NAME=ARGS (e.g. 'sparse=--sparse-attn on'), got {text!r}")
    return Variant(name, shlex.split(args))


def parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise LoadTestError(f"expected A:B (variant names), got {text!r}")
    return a, b


def run_variants(variants: Sequence[Variant], cfg: LoadConfig, corpus: str, transport: Transport, *,
                 server: ServerConfig | None, url: str | None, log_dir: Path | None,
                 progress: Callable[[str], None] = print, server_pid: int | None = None) -> dict[str, Any]:
    jobs: list[Job] | None = None
    runs: dict[str, dict[str, Any]] = {}
    summaries: list[dict[str, Any]] = []
    for v in variants:
        proc: ServerProcess | None = None
        info: dict[str, Any] = {"url": url}
        if url is None:
            assert server is not None
            scfg = ServerConfig(**{**asdict(server), "args": list(server.args) + v.args,
                                   "log_path": (log_dir / f"{v.name}.server.log") if log_dir else None})
            proc = ServerProcess(scfg, transport)
            progress(f"[{v.name}] starting: {shlex.join(scfg.command(0))}")
            t0 = time.monotonic()
            proc.start()
            base = proc.base_url
            info = {"cmd": shlex.join(proc.cmd), "startup_s": round(time.monotonic() - t0, 1),
                    "log": str(scfg.log_path) if scfg.log_path else None}
        else:
            base = url.rstrip("/")
        try:
            if jobs is None:
                progress(f"[{v.name}] building {cfg.requests} requests")
                jobs = plan(corpus, cfg, server_tokenizer(transport, base))
            progress(f"[{v.name}] sending {len(jobs)} requests, concurrency {cfg.concurrency}")
            run = run_load(transport, base, jobs, cfg,
                           pid=proc.proc.pid if proc and proc.proc else server_pid, progress=progress)
            if cfg.isolated:
                progress(f"[{v.name}] isolated reference: {cfg.isolated} prompts one at a time, uncached")
                run["isolated"] = run_isolated(transport, base, jobs, cfg)
            info["alive_after"] = proc.healthy() if proc else True
        finally:
            if proc is not None:
                info["exit_code"] = proc.stop()
                if not info.get("alive_after", False):
                    info["log_tail"] = proc.log_tail(2000)
        runs[v.name] = run
        s = summarize(v.name, run, cfg, info)
        summaries.append(s)
        progress(f"[{v.name}] {s['verdict']} "
                 + "; ".join(f"{c['stage']}: {c['summary']}" for c in s["checks"] if c["passed"] is not True))
    assert jobs is not None
    return {"jobs": jobs, "runs": runs, "summaries": summaries}


def evaluate_pairs(runs: dict[str, dict[str, Any]], expect_equal: Sequence[tuple[str, str]],
                   informative: Sequence[tuple[str, str]], strict_load: bool = False) -> list[dict[str, Any]]:
    """Compare variants on the isolated reference (required for --expect-equal) and under load.

    Under load the text of a request depends on which other requests shared its batches (llama-server
    on CPU is not batch-invariant, dense included), so the under-load agreement is informative unless
    `strict_load`.
    """
    out = []
    for pairs, required in ((expect_equal, True), (informative, False)):
        for a, b in pairs:
            if a not in runs or b not in runs:
                raise LoadTestError(f"unknown variant in {a}:{b} (have {', '.join(runs)})")
            iso = compare(runs[a].get("isolated", []), runs[b].get("isolated", []))
            load = compare(runs[a]["outcomes"], runs[b]["outcomes"])
            ok_iso = iso["different"] == 0 and (iso["compared"] > 0 or not runs[a].get("isolated"))
            ok_load = load["different"] == 0 and load["compared"] > 0
            passed = not required or (ok_iso and (ok_load or not strict_load))
            if required and not runs[a].get("isolated") and not strict_load:
                passed = ok_load  # no isolated reference: the load comparison is all there is
            out.append({"a": a, "b": b, "required": required, "passed": passed,
                        "isolated": iso, "load": load})
    return out


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summaries"]
    cols = [x["name"] for x in s]
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("requests (started / completed)", lambda x: f"{x['requests']} ({x['started']} / {x['completed']})"),
        ("streamed / cancelled / v1 / repeats",
         lambda x: f"{x['streamed']} / {x['cancelled']} / {x['v1']} / {x['repeats']}"),
        ("requests with errors", lambda x: x["with_errors"]),
        ("HTTP 5xx", lambda x: x["http_5xx"]),
        ("error kinds", lambda x: ", ".join(f"{k} {n}" for k, n in x["error_kinds"].items()) or "-"),
        ("echoed prompt == sent prompt", lambda x: x["echo_exact"]),
        ("repeat pairs (mismatches)",
         lambda x: f"{x['determinism']['pairs']} ({x['determinism']['mismatches']})"),
        ("latency p50 / p99 (s)", lambda x: f"{x['latency_p50_s']} / {x['latency_p99_s']}"),
        ("TTFT p50, streams (s)", lambda x: x["ttft_p50_s"]),
        ("prompt tok/s (server timings)", lambda x: x["prompt_tps_per_request"]),
        ("decode tok/s per request (server timings)", lambda x: x["decode_tps_per_request"]),
        ("generated tok/s aggregate (wall)", lambda x: x["generated_tps_aggregate"]),
        ("prompt tokens evaluated / cached", lambda x: f"{x['prompt_tokens']} / {x['cached_tokens']}"),
        ("wall (s)", lambda x: x["wall_s"]),
        ("RSS start / warm / peak / end (MiB)",
         lambda x: "-" if not x["rss"] else
         " / ".join(str(x["rss"].get(k, "-")) for k in ("start_mib", "warm_mib", "peak_mib", "end_mib"))),
        ("RSS peak above warm-up (MiB)",
         lambda x: "-" if not x["rss"] else x["rss"].get("peak_after_warmup_mib", "-")),
        ("GPU memory warm / peak (MiB)",
         lambda x: "-" if not x.get("gpu") else f"{x['gpu'].get('warm_mib', '-')} / {x['gpu']['peak_mib']}"),
        ("answers holding the key of their own context", lambda x: x.get("key_echo", "-")),
        ("failed checks",
         lambda x: ", ".join(c["stage"] for c in x["checks"] if c["passed"] is False) or "none"),
        ("not checked", lambda x: "; ".join(x.get("not_checked", [])) or "none"),
    ]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(str(f(x)) for x in s) + " |" for label, f in rows]
    lines.append("")
    for x in s:
        det = x["isolated"]["determinism"]
        lines.append(f"- {x['name']}: isolated reference {x['isolated']['requests']} requests, "
                     f"repeat identical {det['pairs'] - det['mismatches']}/{det['pairs']}")
    for c in result.get("comparisons", []):
        kind = "required identical" if c["required"] else "informative"
        i, ld = c["isolated"], c["load"]
        lines.append(f"- {c['a']} vs {c['b']} ({kind}): isolated {i['identical']}/{i['compared']} identical, "
                     f"under load {ld['identical']}/{ld['compared']} identical"
                     + ("" if c["passed"] else " **FAIL**"))
    return "\n".join(lines) + "\n"


def _jsonable(result: dict[str, Any], with_outcomes: bool) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in result.items() if k not in ("jobs", "runs")}
    out["schedule"] = [{"pos": j.pos, "rid": j.spec.rid, "n_tokens": j.spec.n_tokens, "endpoint": j.endpoint,
                        "stream": j.stream, "cancel_after": j.cancel_after, "repeat_of": j.repeat_of}
                       for j in result["jobs"]]
    if with_outcomes:
        out["outcomes"] = {name: [asdict(o) for o in run["outcomes"]] for name, run in result["runs"].items()}
        out["isolated_outcomes"] = {name: [asdict(o) for o in run.get("isolated", [])]
                                    for name, run in result["runs"].items()}
    return out


def build_parser(prog: str = "python3 -m opencoti_patch.quality.loadtest") -> argparse.ArgumentParser:
    d = LoadConfig()
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("server")
    src.add_argument("--server", type=Path, help="llama-server binary (started per variant)")
    src.add_argument("--model", type=Path, help="GGUF model for llama-server")
    src.add_argument("--url", help="use this running server instead (one variant; RSS/GPU memory only "
                                   "with --server-pid, else 'not checked')")
    src.add_argument("--server-pid", type=int, help="pid of the --url server (its RSS and GPU memory)")
    src.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                     help="server args of one run, e.g. 'sparse=--sparse-attn on --sparse-attn-topk 8' "
                          "(repeatable; default: dense=--sparse-attn off)")
    src.add_argument("--server-args", default="", help="extra args for every variant (shell-quoted string)")
    src.add_argument("--parallel", type=int, default=4)
    src.add_argument("--ctx", type=int, default=4 * 4096, help="-c (total over the parallel slots)")
    src.add_argument("--threads", type=int, default=None, help="-t for llama-server")
    src.add_argument("--cache-ram", type=int, default=0,
                     help="--cache-ram MiB (0: off, so RSS must stay flat)")
    src.add_argument("--startup-timeout", type=float, default=600.0)
    load = p.add_argument_group("load")
    load.add_argument("--requests", type=int, default=d.requests)
    load.add_argument("--concurrency", type=int, default=d.concurrency)
    load.add_argument("--min-tokens", type=int, default=d.min_tokens, help="prompt length range (tokens)")
    load.add_argument("--max-tokens", type=int, default=d.max_tokens)
    load.add_argument("--shared-prefix-tokens", type=int, default=0,
                      help="common corpus prefix of some prompts (prompt-cache friendly); 0 = none")
    load.add_argument("--shared-prefix-frac", type=float, default=d.shared_prefix_frac,
                      help="share of the prompts with that prefix (the rest start cold)")
    load.add_argument("--n-predict", type=int, default=d.n_predict)
    load.add_argument("--seed", type=int, default=d.seed)
    load.add_argument("--stream-frac", type=float, default=d.stream_frac)
    load.add_argument("--cancel-frac", type=float, default=d.cancel_frac, help="of the streamed requests")
    load.add_argument("--v1-frac", type=float, default=d.v1_frac, help="share sent to /v1/completions")
    load.add_argument("--repeat-frac", type=float, default=d.repeat_frac)
    load.add_argument("--time-limit", type=float, default=d.time_limit_s, help="seconds per server run")
    load.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    load.add_argument("--rss-growth-mib", type=float, default=d.rss_growth_mib,
                      help="max RSS peak above its value after warm-up")
    load.add_argument("--gpu-growth-mib", type=float, default=d.gpu_growth_mib,
                      help="max GPU memory peak above its value after warm-up (where nvidia-smi lists the "
                           "server)")
    load.add_argument("--min-key-echo", "--min-marker-echo", dest="min_key_echo", type=float,
                      default=d.min_key_echo,
                      help="share of finished answers that must repeat the key placed in their own context "
                           "(needs a real model and --n-predict covering the key; 0: not checked)")
    load.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    load.add_argument("--isolated", type=int, default=d.isolated,
                      help="prompts re-sent one at a time, uncached, after the load (the reference that "
                           "--expect-equal and the isolated determinism check use); 0 = none")
    load.add_argument("--strict-load-determinism", action="store_true",
                      help="also require identical text under load (repeats, --expect-equal); llama-server "
                           "is not batch-invariant, so expect this to fail even for dense")
    load.add_argument("--corpus", action="append", default=[], metavar="GLOB",
                      help=f"text files for the prompts (repeatable; default {DEFAULT_CORPUS})")
    chk = p.add_argument_group("checks and output")
    chk.add_argument("--expect-equal", action="append", default=[], metavar="A:B",
                     help="fail unless variants A and B give identical text (e.g. selectall:dense)")
    chk.add_argument("--compare", action="append", default=[], metavar="A:B",
                     help="report (not require) agreement of two variants")
    chk.add_argument("--accept-not-checked", action="append", nargs="?", const="all", default=[],
                     metavar="CHECK",
                     help="exit 0 although this check could not run (repeatable; e.g. gpu_mem_flat on a CPU "
                          f"server; bare: any of {', '.join(STAGES)}); the report still says INCOMPLETE")
    chk.add_argument("--transport", choices=["auto", "requests", "http.client"], default="auto")
    chk.add_argument("--json", dest="json_out", type=Path, help="write the full result as JSON")
    chk.add_argument("--markdown", type=Path, help="write the summary table as Markdown")
    chk.add_argument("--log-dir", type=Path, help="server logs go here (default: beside --json, else none)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog) if prog else build_parser()
    a = parser.parse_args(argv)
    try:
        cfg = LoadConfig(requests=a.requests, concurrency=a.concurrency, min_tokens=a.min_tokens,
                         max_tokens=a.max_tokens, shared_prefix_tokens=a.shared_prefix_tokens,
                         n_predict=a.n_predict, seed=a.seed, stream_frac=a.stream_frac,
                         cancel_frac=a.cancel_frac, v1_frac=a.v1_frac, repeat_frac=a.repeat_frac,
                         time_limit_s=a.time_limit, request_timeout_s=a.request_timeout,
                         rss_growth_mib=a.rss_growth_mib, warmup_frac=a.warmup_frac, isolated=a.isolated,
                         strict_load_determinism=a.strict_load_determinism,
                         shared_prefix_frac=a.shared_prefix_frac, gpu_growth_mib=a.gpu_growth_mib,
                         min_key_echo=a.min_key_echo)
        cfg.validate()
        variants = [parse_variant(v) for v in a.variant] or [Variant("dense", ["--sparse-attn", "off"])]
        if len({v.name for v in variants}) != len(variants):
            raise LoadTestError("variant names must be unique")
        server: ServerConfig | None = None
        if a.url:
            if len(variants) != 1:
                raise LoadTestError("--url runs a single variant")
        else:
            if not a.server or not a.model:
                raise LoadTestError("--server and --model are required (or --url)")
            if not os.access(a.server, os.X_OK):
                raise LoadTestError(f"{a.server} is not an executable")
            server = ServerConfig(binary=a.server, model=a.model, args=shlex.split(a.server_args),
                                  parallel=a.parallel, ctx=a.ctx, threads=a.threads,
                                  cache_ram_mib=a.cache_ram,
                                  startup_timeout_s=a.startup_timeout)
        equal = [parse_pair(x) for x in a.expect_equal]
        info_pairs = [parse_pair(x) for x in a.compare]
        corpus = load_corpus(a.corpus or [str(Settings.resolve().tree / "docs" / "**" / "*.md")])
        log_dir = a.log_dir or (a.json_out.parent if a.json_out else None)
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
        transport = default_transport(a.transport)
        print(f"transport: {transport.name}", flush=True)
        result = run_variants(variants, cfg, corpus, transport, server=server, url=a.url, log_dir=log_dir,
                              progress=lambda m: print(m, flush=True), server_pid=a.server_pid)
        result["comparisons"] = evaluate_pairs(result["runs"], equal, info_pairs, cfg.strict_load_determinism)
        server_json = None if server is None else {**asdict(server), "binary": str(server.binary),
                                                   "model": str(server.model)}
        result["config"] = {**asdict(cfg), "transport": transport.name,
                            "variants": [asdict(v) for v in variants], "server": server_json}
        verdict, checks = overall_verdict(result)
        result["verdict"], result["passed"] = verdict.verdict, verdict.passed
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    md = render_markdown(result)
    print(md)
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        write_report(a.markdown, md)
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_report(a.json_out, json.dumps(_jsonable(result, True), indent=1, default=str) + "\n")
    why = "; ".join(f"{c.name}: {c.summary}" for c in checks if c.passed is not True)
    print(verdict.verdict + (f" ({why})" if why else ""), flush=True)
    accepted = STAGES if "all" in a.accept_not_checked else a.accept_not_checked
    return EXIT_OK if verdict.accepts(accepted) else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
