"""The load: the schedule sent from a pool of client threads while the server's memory (RSS, GPU) is
sampled, then the isolated reference one request at a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..runinfo import gpu_memory_mib
from .client import Outcome, run_one
from .http import Transport
from .schedule import Job, LoadConfig, isolated_jobs

MIN_MEMORY_SAMPLES = 3  # from the post-warm-up baseline to the end: baseline, >= 1 during the load, end


class RssSampler:
    """Samples VmRSS of a pid (and how many requests were done at that time) in a thread, and on demand
    (:meth:`sample`: the load samples after every request); with ``gpu`` (pid -> MiB or None, e.g.
    :func:`~opencoti_patch.lab.runinfo.gpu_memory_mib`) its GPU memory too."""

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
             gpu: Callable[[int], int | None] | None = gpu_memory_mib) -> dict[str, Any]:
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


def run_isolated(transport: Transport, base_url: str, jobs: Sequence[Job], cfg: LoadConfig) -> list[Outcome]:
    """One request at a time, prompt cache off: the output no longer depends on batch composition."""
    return [run_one(transport, base_url, j, cfg, cfg.request_timeout_s, cache_prompt=False)
            for j in isolated_jobs(jobs, cfg.isolated)]
