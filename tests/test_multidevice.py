"""Unit tests of the RPC layout check (opencoti_patch.lab.multidevice): log parsing and the verdicts, on
synthetic logit dumps and llama.cpp log lines (the real run: tests/test_build_real.py, ci/device/rpc.sh)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from opencoti_patch.errors import CheckFailed, OpencotiError
from opencoti_patch.lab import multidevice as md

N_VOCAB = 8

LOG = """\
load_tensors:          CPU model buffer size =    10.00 MiB
llama_kv_cache: layer   0: dev = CPU
llama_kv_cache: layer   1: dev = CPU
llama_kv_cache: layer   2: dev = CPU
llama_kv_cache: layer   3: dev = RPC0
llama_kv_cache:        CPU KV buffer size =    16.00 MiB
llama_kv_cache: RPC0[127.0.0.1:5000] KV buffer size =     4.00 MiB
llama_sparse_attn_kv:        CPU sparse-attn side-cache buffer size =     1.00 MiB
llama_sparse_attn_kv: RPC0[127.0.0.1:5000] sparse-attn side-cache buffer size =     1.00 MiB
llama_sparse_attn_attach: sparse attention on: top-k = 4 blocks, dense layers = 2, min ctx = 1, \
sparse layers = 2, side-cache = 2.00 MiB
graph_reserve: reserving a graph for ubatch with n_tokens =    1, n_seqs =  1, n_outputs =    1
llama_context: graph (pp bs=512, tg bs=1): nodes = 300 / 320, splits = 3 / 3, input objects = 5
"""


def _dump(path: Path, rows: np.ndarray) -> Path:
    rows.astype(np.float32).tofile(path)
    return path


def _run(tmp_path: Path, name: str, rows: np.ndarray, nodes: int, log: str = LOG) -> md.VariantRun:
    dump = _dump(tmp_path / f"{name}.f32", rows)
    (tmp_path / f"{name}.log").write_text(log)
    return md.VariantRun(name, [name], tmp_path / f"{name}.log", dump,
                         {"n_vocab": N_VOCAB,
                          "nodes": {"prefill": 1, "decode_min": nodes, "decode_max": nodes}},
                         md.parse_buffers(log), md.parse_graph(log))


def _runs(tmp_path: Path, *, selectall_delta: float = 0.0, sparse_log: str = LOG,
          sparse_nodes: int = 340) -> dict[str, md.VariantRun]:
    rng = np.random.default_rng(1)
    dense = rng.normal(size=(5, N_VOCAB))
    sparse = dense.copy()
    sparse[:, 0] += 0.01  # the selection changes the logits a little, not the argmax
    sparse[:, dense.argmax(axis=1)] += 1.0
    selectall = dense.copy()
    selectall[2, 3] += selectall_delta
    return {"local-dense": _run(tmp_path, "local-dense", dense, 320),
            "split-dense": _run(tmp_path, "split-dense", dense, 320),
            "split-selectall": _run(tmp_path, "split-selectall", selectall, 340),
            "split-sparse": _run(tmp_path, "split-sparse", sparse, sparse_nodes, sparse_log),
            "local-sparse": _run(tmp_path, "local-sparse", sparse, sparse_nodes)}


def test_parse_buffers_and_graph() -> None:
    bufs = md.parse_buffers(LOG)
    assert {"buffer": "RPC0[127.0.0.1:5000]", "kind": "sparse-attn side-cache", "mib": 1.0} in bufs
    assert [b["kind"] for b in bufs].count("KV") == 2
    assert md.parse_graph(LOG) == {"nodes_pp": 300, "nodes_tg": 320, "splits_pp": 3, "splits_tg": 3}
    assert md.parse_graph("llama_context: graph: nodes = 7, splits = 2, input objects = 1") == \
        {"nodes_pp": 7, "nodes_tg": 7, "splits_pp": 2, "splits_tg": 2}
    assert md.parse_graph("nothing here") == {}


def test_evaluate_passes_on_a_consistent_layout(tmp_path: Path) -> None:
    out = md.evaluate(_runs(tmp_path), N_VOCAB)
    assert out["passed"], out["checks"]
    place = {p["buffer"]: p for p in out["placement"]}
    assert place["RPC0[127.0.0.1:5000]"]["sparse_layers"] == [3] and place["CPU"]["sparse_layers"] == [2]
    assert place["CPU"]["expected_side_mib"] == pytest.approx(1.0)
    md.raise_on_failure(out)


def test_evaluate_catches_each_failure(tmp_path: Path) -> None:
    def failed(**kw: object) -> set[str]:
        out = md.evaluate(_runs(tmp_path, **kw), N_VOCAB)  # type: ignore[arg-type]
        assert out["verdict"] == ("PASS" if out["passed"] else "FAIL")
        return {c["name"] for c in out["checks"] if c["passed"] is not True}

    # one float of select-all off by a tiny amount is a failure: the plumbing must be exact
    assert failed(selectall_delta=1e-6) == {"select-all = dense (split)"}
    # the side-cache only on the local device: the key sums do not follow the layers
    local_only = "\n".join(x for x in LOG.splitlines() if not ("RPC0" in x and "side-cache" in x))
    local_only = local_only.replace("side-cache buffer size =     1.00", "side-cache buffer size =     2.00")
    assert failed(sparse_log=local_only) == {"side-cache on the layers' devices"}
    # side-cache on both, but not as the layers are (layer 3 moved to the local device)
    assert failed(sparse_log=LOG.replace("layer   3: dev = RPC0", "layer   3: dev = CPU")) == \
        {"side-cache on the layers' devices"}
    # one more split in the decode graph with sparse attention: a per-token copy across devices
    assert failed(sparse_log=LOG.replace("splits = 3 / 3", "splits = 3 / 5")) == \
        {"no extra graph splits with sparse attention"}
    # no more nodes than dense: the selection did not run
    assert failed(sparse_nodes=320) == {"the selection runs (split)"}
    with pytest.raises(OpencotiError, match="select-all"):
        md.raise_on_failure(md.evaluate(_runs(tmp_path, selectall_delta=1.0), N_VOCAB))


def test_no_check_is_incomplete_never_pass(tmp_path: Path) -> None:
    # the dict checks used to pass on an empty list: all([]) is True
    with pytest.raises(CheckFailed, match="INCOMPLETE"):
        md.raise_on_failure({"checks": []})
    out = md.evaluate(_runs(tmp_path), N_VOCAB)
    assert out["verdict"] == "PASS" and {c["stage"] for c in out["checks"]} == set(md.STAGES)
    partial = {"checks": [c for c in out["checks"] if c["stage"] != "side-cache"]}  # a stage absent
    assert md.result_verdict(partial).missing_stages == ("side-cache",)
    with pytest.raises(CheckFailed, match="INCOMPLETE"):
        md.raise_on_failure(partial)


def test_variant_args() -> None:
    cfg = md.RpcCheckConfig(harness=Path("h"), rpc_server=Path("s"), model=Path("m"), work=Path("w"),
                            split_args=("-ngl", "2"), local_args=("-ngl", "0"), topk=3)
    assert md.variant_args(cfg, "split-sparse", "h:1") == \
        ["--rpc", "h:1", "-ngl", "2", "--sparse-attn", "on", "--sparse-attn-topk", "3",
         "--sparse-attn-min-ctx", "1"]
    assert md.variant_args(cfg, "local-dense", "h:1") == ["-ngl", "0", "--sparse-attn", "off"]


def test_rpc_server_waits_for_the_port_and_reports_a_dead_server(tmp_path: Path) -> None:
    port = md.free_port()
    listener = tmp_path / "listen.py"
    listener.write_text("import socket, sys, time\n"
                        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                        "s.bind((sys.argv[2], int(sys.argv[4]))); s.listen(); time.sleep(60)\n")
    exe = tmp_path / "fake-rpc-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {listener} \"$@\"\n")
    exe.chmod(0o755)
    with md.rpc_server(exe, "127.0.0.1", port, tmp_path / "s.log") as endpoint:
        assert endpoint == f"127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    dead = tmp_path / "dead-rpc-server"
    dead.write_text("#!/bin/sh\necho 'error: no device CUDA9'\nexit 1\n")
    dead.chmod(0o755)
    with pytest.raises(OpencotiError, match="no device CUDA9"), \
            md.rpc_server(dead, "127.0.0.1", md.free_port(), tmp_path / "d.log"):
        pass
    with pytest.raises(OpencotiError, match="GGML_RPC=ON"), \
            md.rpc_server(tmp_path / "missing", "127.0.0.1", port, tmp_path / "m.log"):
        pass


def test_portable_args() -> None:
    work = Path("/scratch/md")
    assert md.portable_args(["/opt/b/opencoti-harness", "-m", "/models/x.gguf", "--dump-logits",
                             "/scratch/md/split-dense/logits.f32", "-ngl", "2"], work) == \
        ["opencoti-harness", "-m", "x.gguf", "--dump-logits", "<work>/split-dense/logits.f32", "-ngl", "2"]


def test_parse_layers_leaves_out_the_swa_cache() -> None:
    log = ("llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells\n"
           "llama_kv_cache: layer   0: filtered\nllama_kv_cache: layer   5: dev = CPU\n"
           "llama_kv_cache: layer  11: dev = RPC0\n"
           "llama_kv_cache_iswa: creating     SWA KV cache, size = 768 cells\n"
           "llama_kv_cache: layer   4: dev = CPU\nllama_kv_cache: layer   6: dev = RPC0\n"
           "llama_sparse_attn_attach: sparse attention on: top-k = 4 blocks, dense layers = 2, min ctx = 1, "
           "sparse layers = 2, side-cache = 0.50 MiB\n")
    layers = md.parse_layers(log)
    assert layers["devices"] == {5: "CPU", 11: "RPC0", 4: "CPU", 6: "RPC0"} and layers["swa"] == {4, 6}
    run = md.VariantRun("x", [], Path("x"), Path("x"), {}, md.parse_buffers(
        "llama_sparse_attn_kv:        CPU sparse-attn side-cache buffer size =     0.25 MiB\n"
        "llama_sparse_attn_kv: RPC0[h:1] sparse-attn side-cache buffer size =     0.25 MiB\n"))
    place = {p["buffer"]: p for p in md.side_cache_placement(run, layers)}
    assert place["CPU"]["sparse_layers"] == [5] and place["RPC0[h:1]"]["sparse_layers"] == [11]
    assert place["CPU"]["expected_side_mib"] == pytest.approx(0.25)
    # the KV of both caches of an iSWA model counts
    two = md.parse_buffers("llama_kv_cache:        CPU KV buffer size =     4.00 MiB\n"
                           "llama_kv_cache:        CPU KV buffer size =     8.00 MiB\n")
    run2 = md.VariantRun("y", [], Path("y"), Path("y"), {}, two)
    assert md.side_cache_placement(run2, layers)[0]["kv_mib"] == pytest.approx(12.0)


def test_sparse_split_within_the_dense_layouts_own_difference(tmp_path: Path) -> None:
    """Where the two layouts differ numerically (dense split != dense local), sparse split may differ from
    sparse local as much, not more: the bar is 2x the dense difference + 1e-3 in mean KL."""
    runs = _runs(tmp_path)
    rows = np.fromfile(runs["local-dense"].dump, dtype=np.float32).reshape(-1, N_VOCAB).astype(np.float64)
    _dump(runs["split-dense"].dump, rows + 0.01)  # the same shift everywhere: KL 0, not identical
    _dump(runs["split-selectall"].dump, rows + 0.01)
    wobble = np.random.default_rng(2).normal(scale=0.02, size=rows.shape)
    sparse = np.fromfile(runs["local-sparse"].dump, dtype=np.float32).reshape(-1, N_VOCAB).astype(np.float64)
    _dump(runs["split-sparse"].dump, sparse + wobble)  # small KL: passes
    out = md.evaluate(runs, N_VOCAB)
    assert out["passed"], out["checks"]
    _dump(runs["split-sparse"].dump, sparse + 40 * wobble)  # far from sparse local: fails
    bad = {c["name"] for c in md.evaluate(runs, N_VOCAB)["checks"] if c["passed"] is not True}
    assert bad == {"sparse split = sparse local"}
