"""Per-step kernel profile from a kernel-trace.cpp timeline (stdlib only: runs on the device's python3).

    python3 ci/device/kernel_profile.py trace.tsv [--gap-us 30] [--min-steps 4] [--json out.json] > profile.md

A *step* is a run of GPU activity with no idle gap longer than --gap-us: one llama_decode (a prompt
ubatch or a decode token), since the host synchronizes between them. Steps with the same sequence of
kernels form a group (all decode tokens of one configuration, all prompt ubatches of another); for
each group with at least --min-steps steps the table gives, per kernel, the calls per step and the
GPU time per step (mean over the group's steps), then the step's busy time (sum of its activities)
and span (first start to last end). Kernels launched with programmatic dependent launch start before
their predecessor ends and wait on the GPU, so their durations overlap: *exclusive* time counts only
what an activity adds past everything that started before it (the exclusive times of a step add up
to its span minus idle time). *gap* is the idle time from the end of a step to the start of the next
step of the same group: host work between two decode tokens or prompt ubatches (graph build, inputs
such as the KQ mask, sampling); copies and stray steps of one or two kernels in it are part of the gap.
Where the trace has the runtime API calls (kind R), each gap is split into the time
inside CUDA calls, per call (cudaGraphLaunch, cudaMemcpyAsync, ...; clipped to the gap) and the time
outside any CUDA call: the program's own host work (medians over the gaps).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Activity:
    kind: str
    start: int
    end: int
    name: str


@dataclass
class Group:
    signature: tuple[str, ...]
    steps: list[list[Activity]] = field(default_factory=list)
    gap_windows: list[tuple[int, int]] = field(default_factory=list)  # (end of a step, start of the next), ns


def demangle(names: set[str]) -> dict[str, str]:
    """Mangled -> readable, through cu++filt or c++filt when the machine has one; else as they are."""
    mangled = sorted(n for n in names if n.startswith("_Z"))
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    out = {n: n for n in names}
    if tool and mangled:
        text = "\n".join(mangled) + "\n"
        res = subprocess.run([tool], input=text, capture_output=True, text=True, check=False)
        lines = res.stdout.splitlines()
        if res.returncode == 0 and len(lines) == len(mangled):
            out.update(zip(mangled, lines, strict=True))
    return out


def short_name(name: str, width: int = 72) -> str:
    """A kernel's function name with its template arguments kept only as far as `width` allows."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*\)$", "", name)  # the parameter list
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def read_trace(path: str) -> list[Activity]:
    rows: list[tuple[str, int, int, str]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().rstrip("\n").split("\t")
        i_kind, i_start, i_end, i_name = (header.index(k) for k in ("kind", "start", "end", "name"))
        for line in f:
            p = line.rstrip("\n").split("\t")
            if len(p) < len(header):
                continue
            rows.append((p[i_kind], int(p[i_start]), int(p[i_end]), p[i_name]))
    names = demangle({r[3] for r in rows if r[0] == "K"})
    acts = []
    for kind, start, end, name in rows:
        if kind == "K":
            name = short_name(names.get(name, name))
        acts.append(Activity(kind, start, end, name))
    acts.sort(key=lambda a: a.start)
    return acts


def split_steps(acts: list[Activity], gap_ns: int) -> list[list[Activity]]:
    steps: list[list[Activity]] = []
    cur: list[Activity] = []
    last_end = 0
    for a in acts:
        if cur and a.start - last_end > gap_ns:
            steps.append(cur)
            cur = []
        cur.append(a)
        last_end = max(last_end, a.end) if len(cur) > 1 else a.end
    if cur:
        steps.append(cur)
    return steps


# a step of at most this many kernels/memsets is not a step of its own (see group_steps); a decode or prompt
# ubatch of any model launches hundreds
STRAY_MAX_KERNELS = 2


def group_steps(steps: list[list[Activity]], min_steps: int) -> list[Group]:
    groups: dict[tuple[str, ...], Group] = {}
    prev: tuple[tuple[str, ...], int] | None = None
    for s in steps:
        sig = tuple(a.name.split(":")[0] for a in s if a.kind in "KS")
        if len(sig) <= STRAY_MAX_KERNELS:
            # copies only (the inputs a decode uploads before its graph, the logits after it, once the GPU
            # has caught up with the host), or a stray kernel or two (a prompt ubatch's output norm after a
            # host-side split): part of the gap between two steps of a group, not a step of its own
            continue
        g = groups.setdefault(sig, Group(sig))
        g.steps.append(s)
        if prev is not None and prev[0] == sig:
            g.gap_windows.append((prev[1], s[0].start))
        prev = (sig, max(a.end for a in s))
    out = [g for g in groups.values() if len(g.steps) >= min_steps]
    out.sort(key=lambda g: (g.steps[0][0].start))
    return out


def label(g: Group) -> str:
    names = " ".join(g.signature)
    prompt = re.search(r"mul_mat_q\b|mul_mat_q<|cutlass|gemm", names)
    phase = "prompt" if prompt else "decode"
    sparse = "sparse" if "sparse_attn" in names else "dense"
    return f"{sparse} {phase}"


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def host_breakdown(windows: list[tuple[int, int]], api: list[Activity]) -> dict | None:
    """The host gaps between steps split into time inside CUDA runtime calls (per call, clipped to the gap)
    and time outside any of them; medians over the gaps, in µs. None without API records."""
    if not api or not windows:
        return None
    starts = [a.start for a in api]  # api is sorted by start
    longest = max(a.end - a.start for a in api)
    outside: list[float] = []
    per_call: dict[str, list[float]] = defaultdict(list)
    for w0, w1 in windows:
        inside: dict[str, int] = defaultdict(int)
        union = 0
        covered = w0
        for a in api[bisect.bisect_left(starts, w0 - longest) : bisect.bisect_right(starts, w1)]:
            c0, c1 = max(a.start, w0), min(a.end, w1)
            if c1 <= c0:
                continue
            inside[a.name] += c1 - c0
            union += max(0, c1 - max(c0, covered))
            covered = max(covered, c1)
        outside.append((w1 - w0 - union) / 1e3)
        for name in set(per_call) | set(inside):
            per_call[name].append(inside.get(name, 0) / 1e3)
    n = len(windows)
    calls = {name: _median(v + [0.0] * (n - len(v))) for name, v in per_call.items()}
    return {
        "outside_cuda_us_median": _median(outside),
        "cuda_calls_us_median": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
    }


def summarize(g: Group, api: list[Activity] | None = None) -> dict:
    n = len(g.steps)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # calls, ns, exclusive ns
    busy = 0
    spans = [max(a.end for a in s) - s[0].start for s in g.steps]  # ns, per step
    for s in g.steps:
        covered = s[0].start  # everything before this is accounted for
        for a in s:
            key = a.name if a.kind == "K" else a.name.split(":")[0]
            per_kernel[key][0] += 1
            per_kernel[key][1] += a.end - a.start
            per_kernel[key][2] += max(0, a.end - max(a.start, covered))
            covered = max(covered, a.end)
            busy += a.end - a.start
    kernels = [
        {
            "name": k,
            "calls_per_step": v[0] / n,
            "us_per_step": v[1] / n / 1e3,
            "us_per_call": v[1] / v[0] / 1e3,
            "exclusive_us_per_step": v[2] / n / 1e3,
        }
        for k, v in per_kernel.items()
    ]
    kernels.sort(key=lambda k: -k["exclusive_us_per_step"])
    gaps = sorted(start - end for end, start in g.gap_windows)  # ns
    gap_after = {start: (start - end) / 1e3 for end, start in g.gap_windows}  # µs, by the later step's start
    return {
        "label": label(g),
        "steps": n,
        "activities_per_step": len(g.signature),
        "busy_us_per_step": busy / n / 1e3,
        "span_us_per_step": sum(spans) / n / 1e3,
        "gap_us_median": gaps[len(gaps) // 2] / 1e3 if gaps else None,
        "host": host_breakdown(g.gap_windows, api or []),
        "kernels": kernels,
        # per step, in timeline order (a prompt's ubatches by depth): span, and the gap after the previous
        # step of the group (None: none right before it)
        "step_span_us": [sp / 1e3 for sp in spans],
        "step_gap_us": [gap_after.get(st[0].start) for st in g.steps],
    }


def render(groups: list[dict], top: int) -> str:
    out = []
    for i, g in enumerate(groups):
        gap = f", host gap {g['gap_us_median']:.1f} µs (median)" if g["gap_us_median"] is not None else ""
        out.append(
            f"### group {i}: {g['label']} — {g['steps']} steps, "
            f"{g['activities_per_step']} activities per step, "
            f"GPU busy {g['busy_us_per_step']:.1f} µs, span {g['span_us_per_step']:.1f} µs per step{gap}\n"
        )
        host = g.get("host")
        if host:
            top_calls = list(host["cuda_calls_us_median"].items())[:6]
            calls = ", ".join(f"`{k}` {v:.1f}" for k, v in top_calls if v > 0)
            out.append(
                f"Host gap (median): {host['outside_cuda_us_median']:.1f} µs outside CUDA calls; "
                f"inside: {calls or 'none'} (µs).\n"
            )
        out.append("| kernel | calls/step | exclusive µs/step | share of span | µs/step | µs/call |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for k in g["kernels"][:top]:
            share = k["exclusive_us_per_step"] / g["span_us_per_step"] if g["span_us_per_step"] else 0.0
            name = k["name"].replace("|", "\\|")
            out.append(
                f"| `{name}` | {k['calls_per_step']:.1f} | {k['exclusive_us_per_step']:.1f} | {share:.1%} "
                f"| {k['us_per_step']:.1f} | {k['us_per_call']:.2f} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gap-us", type=float, default=30.0)
    ap.add_argument("--min-steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    acts = read_trace(args.trace)
    if not acts:
        print(f"{args.trace}: no activities", file=sys.stderr)
        return 1
    api = [a for a in acts if a.kind == "R"]
    gpu = [a for a in acts if a.kind != "R"]
    if not gpu:
        print(f"{args.trace}: no GPU activities", file=sys.stderr)
        return 1
    steps = split_steps(gpu, int(args.gap_us * 1e3))
    groups = [summarize(g, api) for g in group_steps(steps, args.min_steps)]
    print(
        f"{len(gpu)} GPU activities, {len(api)} CUDA calls, {len(steps)} steps, "
        f"{len(groups)} groups of >= {args.min_steps} steps\n"
    )
    print(render(groups, args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": args.trace, "gap_us": args.gap_us, "groups": groups}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
