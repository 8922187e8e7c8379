"""Sparse attention with the layers on two devices: a local one and a llama.cpp RPC server.

One harness prompt, decoded in five variants:

- ``local-dense`` / ``local-sparse``: every offloaded layer on the local device(s);
- ``split-dense`` / ``split-selectall`` / ``split-sparse``: the layers split between the local device and an
  RPC server on loopback (``ggml-rpc-server``; ``--rpc HOST:PORT`` plus the split arguments, e.g. ``-ngl 2``
  on a CPU build, where the RPC device is the only offload target, or ``-ngl 99 -ts 1,1`` on a GPU build).

The first variant decodes greedily, the others are fed its tokens (teacher-forced: one near-tie flipped by
the backends' numerics would otherwise make a free-running decode diverge). Checks: select-all gives bitwise
the dense logits in the split layout (the plumbing is exact across devices); sparse decode in the split layout
agrees with sparse decode on one device (bitwise where both layouts compute the same way; otherwise no further
from it than dense split is from dense on one device); the selection really runs (more graph nodes than
dense, other logits); each device's side-cache of key sums is what its sparse layers need; and the scheduler
needs no more graph splits with sparse attention than without (no per-token copy of the bounds across
devices). The RPC server is started and stopped here, its log kept. Each check is a
:class:`..verdict.Check` of its own stage (:data:`STAGES`), the verdict ``verdict_of``'s: no check (or a
stage without a passed check) is INCOMPLETE, never PASS.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..builds.harness import SINGLE_EXE, build_harness
from ..config import Settings, write_report
from ..errors import CheckFailed, OpencotiError
from ..report import render
from ..verdict import Check, Verdict, verdict_of
from ..verify.identical import parse_log_facts
from .logits import compare_logits
from .serving.server import free_port

VARIANTS = ("local-dense", "split-dense", "split-selectall", "split-sparse", "local-sparse")

_SIDE_CACHE_RE = re.compile(r"^\S+:\s+(\S+) sparse-attn side-cache buffer size =\s+([\d.]+) MiB", re.M)
_MIB_RE = re.compile(r"^(\S+) ([\d.]+) MiB$")  # a buffer fact of parse_log_facts: "CPU 16.00 MiB"
_NODES_SPLITS_RE = re.compile(r"^nodes = (\d+)(?: / (\d+))?, splits = (\d+)(?: / (\d+))?")
_LAYER_DEV_RE = re.compile(r"^llama_kv_cache: layer +(\d+): dev = (\S+)", re.M)
_CACHE_RE = re.compile(r"creating\s+(non-SWA|SWA) KV cache")
_ATTACH_RE = re.compile(r"sparse attention on: .*dense layers = (\d+),.* sparse layers = (\d+)")
_DENSE_LAST_RE = re.compile(r"sparse attention on: .*dense last = (\d+),")
SERVER_EXES = ("ggml-rpc-server", "rpc-server")  # the tool's name in this pin, and in older trees
# one stage per check of a layout; PASS needs a passed check of each
STAGES = ("select-all", "sparse split", "selection", "side-cache", "graph splits")


@dataclass(frozen=True)
class RpcCheckConfig:
    harness: Path                      # opencoti-harness built against the build (with libllama-common)
    rpc_server: Path                   # the same build's rpc-server
    model: Path
    work: Path
    split_args: tuple[str, ...]        # how the layers are split between local and RPC (e.g. -ngl 2)
    local_args: tuple[str, ...]        # the same layers on the local device only (e.g. -ngl 0 / -ngl 99)
    server_device: str | None = None   # rpc-server -d (e.g. CUDA0); None: its default
    prompt_tokens: int = 2048
    decode: int = 16
    ctx: int = 4096
    topk: int = 4                      # real selection: blocks kept besides sink and recent
    threads: int = 2
    extra: tuple[str, ...] = ()        # more harness flags for every variant (e.g. -ctk q8_0 -ctv q8_0)
    host: str = "127.0.0.1"
    port: int = 0                      # 0: a free port


@dataclass
class VariantRun:
    name: str
    cmd: list[str]
    log: Path
    dump: Path
    summary: dict[str, Any]
    buffers: list[dict[str, Any]] = field(default_factory=list)
    graph: dict[str, int] = field(default_factory=dict)


def _accepts(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@contextlib.contextmanager
def rpc_server(exe: Path, host: str, port: int, log: Path, device: str | None = None,
               threads: int | None = None, timeout: float = 120.0) -> Iterator[str]:
    """Run ``rpc-server`` on HOST:PORT while the block runs; yields the endpoint ``HOST:PORT``.

    Waits until the port accepts (the server prints its devices first), fails with the server's log if it
    exits or does not listen in ``timeout`` seconds, and stops it afterwards (terminate, then kill)."""
    if not exe.is_file():
        raise OpencotiError(f"no RPC server at {exe}: build the tree with -DGGML_RPC=ON "
                            f"(target {SERVER_EXES[0]})")
    cmd = [str(exe), "-H", host, "-p", str(port)]
    if device:
        cmd += ["-d", device]
    if threads:
        cmd += ["-t", str(threads)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while not _accepts(host, port):
                if proc.poll() is not None or time.monotonic() - t0 > timeout:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                    raise OpencotiError(f"{exe.name} did not start listening on {host}:{port} (log {log}):\n"
                                        + tail)
                time.sleep(0.2)
            yield f"{host}:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def parse_buffers(log_text: str) -> list[dict[str, Any]]:
    """The KV buffers (verify-identical's log facts) and the sparse-attn side-cache buffers of a llama.cpp
    log, by buffer name."""
    out = [{"buffer": m.group(1), "kind": "KV", "mib": float(m.group(2))}
           for fact in parse_log_facts(log_text)["kv_buffer"] if (m := _MIB_RE.match(fact))]
    return out + [{"buffer": m.group(1), "kind": "sparse-attn side-cache", "mib": float(m.group(2))}
                  for m in _SIDE_CACHE_RE.finditer(log_text)]


def parse_graph(log_text: str) -> dict[str, int]:
    """Nodes and splits of the last reserved graph (verify-identical's ``graph`` log fact: ``nodes = N,
    splits = S`` or the pp / tg pair)."""
    facts = parse_log_facts(log_text)["graph"]
    m = _NODES_SPLITS_RE.match(facts[-1]) if facts else None
    if m is None:
        return {}
    nodes_pp, nodes_tg, splits_pp, splits_tg = m.groups()
    return {"nodes_pp": int(nodes_pp), "nodes_tg": int(nodes_tg or nodes_pp),
            "splits_pp": int(splits_pp), "splits_tg": int(splits_tg or splits_pp)}


def variant_args(cfg: RpcCheckConfig, name: str, endpoint: str) -> list[str]:
    where = [*("--rpc", endpoint), *cfg.split_args] if name.startswith("split-") else list(cfg.local_args)
    sparse = {
        "dense": ["--sparse-attn", "off"],
        # every block selected, selection from the first token on: must be the dense logits bit for bit
        "selectall": ["--sparse-attn", "on", "--sparse-attn-topk", "100000", "--sparse-attn-min-ctx", "1"],
        "sparse": ["--sparse-attn", "on", "--sparse-attn-topk", str(cfg.topk), "--sparse-attn-min-ctx", "1"],
    }[name.split("-", 1)[1]]
    return [*where, *sparse]


def run_variant(cfg: RpcCheckConfig, name: str, endpoint: str, teacher: Path | None = None) -> VariantRun:
    """One harness run; ``teacher``: feed these decode tokens (the reference run's) instead of the argmax."""
    out = cfg.work / name
    out.mkdir(parents=True, exist_ok=True)
    dump, js, log = out / "logits.f32", out / "run.json", out / "run.log"
    for p in (dump, js):
        p.unlink(missing_ok=True)
    cmd = [str(cfg.harness), "-m", str(cfg.model), "-c", str(cfg.ctx), "-fa", "on", "-t", str(cfg.threads),
           "--prompt-tokens", str(cfg.prompt_tokens), "--decode", str(cfg.decode), "--seed", "42",
           "--dump-logits", str(dump), "--json", str(js), "--count-nodes",
           "-v",  # the layer -> device lines of the log
           *(["--teacher-forced", str(teacher)] if teacher else []),
           *cfg.extra, *variant_args(cfg, name, endpoint)]
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    if rc != 0 or not js.is_file() or not dump.is_file():
        tail = "\n".join(text.splitlines()[-20:])
        raise OpencotiError(f"{name}: the harness failed (rc {rc}, log {log}):\n{tail}")
    return VariantRun(name, cmd, log, dump, json.loads(js.read_text()), parse_buffers(text),
                      parse_graph(text))


def parse_layers(log_text: str) -> dict[str, Any]:
    """The KV layer -> device map (llama_kv_cache's debug lines, harness -v), the layers of an iSWA model's
    SWA cache (never sparse), and the dense-layer count of the attach line (layers >= it are sparse)."""
    devices: dict[int, str] = {}
    swa: set[int] = set()
    in_swa = False
    for line in log_text.splitlines():
        if m := _CACHE_RE.search(line):
            in_swa = m.group(1) == "SWA"
        elif m := _LAYER_DEV_RE.match(line):
            devices[int(m.group(1))] = m.group(2)
            if in_swa:
                swa.add(int(m.group(1)))
    m = _ATTACH_RE.search(log_text)
    last = _DENSE_LAST_RE.search(log_text)
    return {"devices": devices, "swa": swa, "dense_layers": int(m.group(1)) if m else None,
            "dense_last": int(last.group(1)) if last else 0,
            "sparse_layers": int(m.group(2)) if m else None}


def side_cache_placement(run: VariantRun, layers: dict[str, Any]) -> list[dict[str, Any]]:
    """Per buffer: KV MiB, side-cache MiB, the sparse layers whose K the device holds, and the side-cache
    expected there (that count x the size of one layer's key sums): equal when the key sums follow the K."""
    kv: dict[str, float] = {}
    side: dict[str, float] = {}
    for b in run.buffers:  # per buffer name, over the caches (an iSWA model has two KV caches)
        into = kv if b["kind"] == "KV" else side
        into[b["buffer"]] = into.get(b["buffer"], 0.0) + b["mib"]
    dense = layers["dense_layers"]
    full = [il for il in sorted(layers["devices"]) if il not in layers["swa"]]
    last = layers.get("dense_last", 0)
    dense_tail = set(full[len(full) - last:]) if last else set()  # the last full-attention layers stay dense
    sparse_on: dict[str, list[int]] = {}
    for il, dev in sorted(layers["devices"].items()):
        if dense is not None and il >= dense and il not in layers["swa"] and il not in dense_tail:
            sparse_on.setdefault(dev, []).append(il)
    n_sparse = sum(map(len, sparse_on.values()))
    per_layer = sum(side.values()) / n_sparse if n_sparse else None
    out = []
    for name in sorted(set(kv) | set(side)):
        mine = sparse_on.get(name.split("[", 1)[0], [])
        out.append({"buffer": name, "kv_mib": kv.get(name), "side_mib": side.get(name), "sparse_layers": mine,
                    "expected_side_mib": per_layer * len(mine) if per_layer is not None else None})
    return out


def _nodes_per_step(run: VariantRun) -> float | None:
    """Graph nodes of the largest decode step (the harness's --count-nodes)."""
    nodes = run.summary.get("nodes") or {}
    return float(nodes["decode_max"]) if "decode_max" in nodes else None


def evaluate(runs: dict[str, VariantRun], n_vocab: int) -> dict[str, Any]:
    """The checks of one RPC layout (pure: unit-tested on synthetic dumps and logs)."""
    checks: list[Check] = []

    def check(name: str, stage: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, stage, bool(ok), detail))

    cmp_sa = compare_logits(runs["split-dense"].dump, runs["split-selectall"].dump, n_vocab)
    check("select-all = dense (split)", "select-all", cmp_sa["identical"],
          "bitwise identical" if cmp_sa["identical"] else
          f"differ: max KL {cmp_sa['kl_max']:.3g}, top-1 agreement {cmp_sa['top1_agreement']:.3f}")
    cmp_sp = compare_logits(runs["local-sparse"].dump, runs["split-sparse"].dump, n_vocab)
    cmp_dd = compare_logits(runs["local-dense"].dump, runs["split-dense"].dump, n_vocab)
    # bitwise where both layouts compute the same way; else (weights repacked on one side only) no further
    # from sparse on one device than dense split is from dense on one device
    tol = 2.0*cmp_dd["kl_mean"] + 1e-3
    check("sparse split = sparse local", "sparse split",
          cmp_sp["identical"] or (not cmp_dd["identical"] and cmp_sp["kl_mean"] <= tol),
          ("bitwise identical" if cmp_sp["identical"] else
           f"top-1 agreement {cmp_sp['top1_agreement']:.3f}, mean KL {cmp_sp['kl_mean']:.3g} (at most "
           f"{tol:.3g}: dense split vs local {cmp_dd['kl_mean']:.3g}), max KL {cmp_sp['kl_max']:.3g}"))
    cmp_sd = compare_logits(runs["split-dense"].dump, runs["split-sparse"].dump, n_vocab)
    nd, ns = _nodes_per_step(runs["split-dense"]), _nodes_per_step(runs["split-sparse"])
    check("the selection runs (split)", "selection",
          nd is not None and ns is not None and ns > nd and not cmp_sd["identical"],
          f"graph nodes per decode step: dense {nd}, sparse {ns}; sparse vs dense top-1 agreement "
          f"{cmp_sd['top1_agreement']:.3f}, mean KL {cmp_sd['kl_mean']:.3g}")
    layers = parse_layers(runs["split-sparse"].log.read_text(errors="replace"))
    place = side_cache_placement(runs["split-sparse"], layers)
    with_side = [p for p in place if p["side_mib"]]
    rpc_side = [p for p in with_side if p["buffer"].upper().startswith("RPC")]
    check("side-cache on the layers' devices", "side-cache",
          len(with_side) >= 2 and bool(rpc_side) and all(
              p["expected_side_mib"] is not None
              and abs((p["side_mib"] or 0.0) - p["expected_side_mib"]) <= 0.01 for p in place),
          "; ".join(f"{p['buffer']}: sparse layers {p['sparse_layers'] or 'none'}, side-cache "
                    f"{p['side_mib'] or 0} MiB (expected {p['expected_side_mib']})" for p in place))
    gd, gs = runs["split-dense"].graph, runs["split-sparse"].graph
    check("no extra graph splits with sparse attention", "graph splits", bool(gd) and bool(gs)
          and gs["splits_tg"] == gd["splits_tg"],
          f"decode graph splits: dense {gd.get('splits_tg')}, sparse {gs.get('splits_tg')}")
    v = verdict_of(checks, STAGES)
    return {"checks": [c.as_dict() for c in checks], "verdict": v.verdict, "passed": v.passed,
            "comparisons": {"selectall_vs_dense_split": cmp_sa, "sparse_split_vs_local": cmp_sp,
                            "dense_split_vs_local": cmp_dd, "sparse_vs_dense_split": cmp_sd},
            "placement": place, "graphs": {n: r.graph for n, r in runs.items()}}


def run_rpc_check(cfg: RpcCheckConfig, variants: Sequence[str] = VARIANTS) -> dict[str, Any]:
    """Start the RPC server, run the variants, evaluate; the result also goes to cfg.work/rpc-check.json."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    port = cfg.port or free_port(cfg.host)
    runs: dict[str, VariantRun] = {}
    with rpc_server(cfg.rpc_server, cfg.host, port, cfg.work / "rpc-server.log", cfg.server_device,
                    cfg.threads) as endpoint:
        # the first variant decodes greedily; the others are fed its tokens, so that every variant is compared
        # on the same contexts (free-running, one near-tie flipped by backend numerics makes the runs diverge)
        teacher = None
        for name in variants:
            runs[name] = run_variant(cfg, name, endpoint, teacher)
            if teacher is None:
                teacher = cfg.work / "decode-tokens.txt"
                teacher.write_text(" ".join(map(str, runs[name].summary["decode_tokens"])) + "\n")
    n_vocab = int(runs[variants[0]].summary["n_vocab"])
    result = evaluate(runs, n_vocab)
    result["commands"] = {n: " ".join(portable_args(r.cmd, cfg.work)) for n, r in runs.items()}
    result["config"] = {"prompt_tokens": cfg.prompt_tokens, "decode": cfg.decode, "topk": cfg.topk,
                        "split_args": list(cfg.split_args), "local_args": list(cfg.local_args),
                        "server_device": cfg.server_device, "extra": list(cfg.extra)}
    (cfg.work / "rpc-check.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def rpc_check_config(build_dir: Path, llama_src: Path, model: Path, work: Path, *, split_args: str,
                     local_args: str, harness_args: Sequence[str] = (), **kw: Any) -> RpcCheckConfig:
    """The check against a build (its bin/: the RPC server, the libraries the harness is built against,
    into ``work/harness``); ``split_args``, ``local_args`` and each of ``harness_args`` are llama.cpp flags
    as one shell-quoted string; ``kw``: the other fields of :class:`RpcCheckConfig`."""
    bin_dir = build_dir / "bin"
    harness = build_harness(llama_src, bin_dir, work / "harness", targets=(SINGLE_EXE,))
    server = next((bin_dir / n for n in SERVER_EXES if (bin_dir / n).is_file()), bin_dir / SERVER_EXES[0])
    return RpcCheckConfig(harness=harness / SINGLE_EXE, rpc_server=server, model=model, work=work / "runs",
                          split_args=tuple(shlex.split(split_args)),
                          local_args=tuple(shlex.split(local_args)),
                          extra=tuple(a for x in harness_args for a in shlex.split(x)), **kw)


def offloaded_layers(cfg: RpcCheckConfig) -> int:
    """The ``-ngl`` of the split layout (0 without one): what the report's machine line names."""
    words = list(cfg.split_args)
    return int(words[words.index("-ngl") + 1]) if "-ngl" in words[:-1] else 0


def save(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    """``<out_dir>/<name>.json`` and its Markdown report; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    write_report(path, json.dumps(result, indent=1, sort_keys=True) + "\n")
    write_report(path.with_suffix(".md"), render(Settings.resolve().templates_dirs, "multidevice-rpc.md.j2",
                                                 **result))
    return path


def portable_args(cmd: Sequence[str], work: Path) -> list[str]:
    """A command line for a report: paths under the work folder as <work>/..., other absolute paths by their
    file name (the machine's folders mean nothing to a reader)."""
    out = []
    for a in cmd:
        if a.startswith("/"):
            p = Path(a)
            out.append(f"<work>/{p.relative_to(work)}" if p.is_relative_to(work) else p.name)
        else:
            out.append(a)
    return out


def result_verdict(result: dict[str, Any]) -> Verdict:
    """The verdict of a layout's result (its checks as :func:`evaluate` wrote them)."""
    checks = [Check.from_dict(c) for c in result.get("checks", [])]
    return verdict_of(checks, STAGES)


def raise_on_failure(result: dict[str, Any]) -> None:
    """Raise unless every check ran and passed (no check at all: INCOMPLETE)."""
    v = result_verdict(result)
    if v.passed:
        return
    bad = [f"{c['name']}: {c['summary']}" for c in result.get("checks", []) if c["passed"] is not True]
    raise CheckFailed(f"RPC layout check {v.verdict}:\n  " + "\n  ".join(bad or v.reasons()))
