"""The load test's verdict: per variant its checks (one stage each, through the shared verdict), the
determinism of repeated prompts, and the comparisons of two variants on the isolated reference and under
load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import OpencotiError
from ...verdict import Check, Verdict, verdict_of
from .client import Outcome
from .load import rss_summary
from .schedule import LoadConfig

# every check of a variant, one stage each (accepted by name when not checked)
STAGES = ("all_started", "no_5xx", "no_transport_errors", "valid_json", "no_server_errors", "attribution",
          "key_echo", "isolated_ok", "isolated_deterministic", "rss_flat", "gpu_mem_flat", "server_alive")


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
    checks = [Check.from_dict(c) for x in result["summaries"] for c in x["checks"]]
    checks += [Check(f"{c['a']} = {c['b']}", "expect_equal", c["passed"],
                     f"isolated {c['isolated']['identical']}/{c['isolated']['compared']} identical, "
                     f"under load {c['load']['identical']}/{c['load']['compared']}")
               for c in result.get("comparisons", []) if c["required"]]
    return verdict_of(checks, STAGES), checks


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise OpencotiError(f"expected A:B (variant names), got {text!r}")
    return a, b


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
                raise OpencotiError(f"unknown variant in {a}:{b} (have {', '.join(runs)})")
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
