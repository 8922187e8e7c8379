"""Unit tests for the benchmark packer/report and the random GGUF writer (no GPU needed)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from opencoti_patch.build.synth_gguf import LlamaShape, import_gguf, write_llama_gguf
from opencoti_patch.quality import bench


def test_pack_slim_drops_unneeded_folders(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    for rel in ("CMakeLists.txt", "src/a.cpp", "docs/big.md", "models/x.gguf", "examples/e/main.cpp",
                "models/templates/t.py"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    out = bench.pack_slim(tree, tmp_path / "slim.tgz")
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
    assert "llama.cpp/src/a.cpp" in names
    assert "llama.cpp/CMakeLists.txt" in names
    assert "llama.cpp/docs/big.md" not in names
    assert "llama.cpp/models/x.gguf" not in names
    assert "llama.cpp/models/templates/t.py" in names
    assert "llama.cpp/examples/e/main.cpp" not in names
    assert "llama.cpp/examples/CMakeLists.txt" in names


def _rec(depth: int, sa: int, tps: float, topk: int = 32) -> dict:
    return {"n_gen": 64, "n_prompt": 0, "n_depth": depth, "type_k": "f16", "avg_ts": tps,
            "stddev_ts": 0.5, "sparse_attn": sa, "sparse_attn_topk": topk, "sparse_attn_block_size": 128}


def test_ratios_pair_sparse_with_dense_of_same_depth(tmp_path: Path) -> None:
    recs = [_rec(8192, 0, 300.0), _rec(8192, 1, 330.0), _rec(131072, 0, 100.0), _rec(131072, 1, 260.0),
            {"n_gen": 0, "n_prompt": 512, "avg_ts": 1.0}]
    p = tmp_path / "b.json"
    p.write_text("log line\n" + json.dumps(recs) + "\ntrailing log\n")
    rows = bench.parse_llama_bench(bench.load_json(p), "8b")
    assert len(rows) == 4
    rs = {c["depth"]: c for c in bench.ratios(rows)}
    assert rs[8192]["ratio"] == pytest.approx(1.1)
    assert rs[131072]["ratio"] == pytest.approx(2.6)
    assert rs[131072]["budget"] == 32 * 128
    table = bench.markdown_table(rows)
    assert "**2.60×**" in table and "| 131072 |" in table and "| 4096 (32 x 128) |" in table


def test_table_tells_block_sizes_apart() -> None:
    """The same token budget in 128- and 32-token blocks: two rows, each with its top-k x block."""
    b32 = dict(_rec(131072, 1, 97.0, topk=128), sparse_attn_block_size=32)
    rows = bench.parse_llama_bench([_rec(131072, 0, 95.0), _rec(131072, 1, 180.0), b32], "8b")
    table = bench.markdown_table(rows)
    assert "| 4096 (32 x 128) | 180.0 |" in table and "| 4096 (128 x 32) | 97.0 |" in table


def test_longctx_reports_pair_by_name(tmp_path: Path) -> None:
    """h200.sh `longctx`: harness JSONs named longctx-KV-DEPTH-dense / -kK-bB become 8b-synth rows
    (decode_tps); a report whose depth disagrees with its name, one without a timed step and other files
    are left out."""
    res = tmp_path / "log"
    res.mkdir()

    def js(name: str, depth: int, tps: float) -> None:
        (res / f"{name}.json").write_text(json.dumps({"synthetic_depth": depth, "decode_tps": tps}))

    js("longctx-f16-524288-dense", 524288, 40.0)
    js("longctx-f16-524288-k32-b128", 524288, 200.0)
    js("longctx-q8_0-1048576-dense", 1048576, 0.0)        # no timed step
    js("longctx-q8_0-1048576-k32-b128", 131072, 90.0)     # not the depth its name says
    js("longctx-f16-524288-dense-profile", 524288, 1.0)   # the tracer's profile, not a harness report
    rows = bench.load_results(res)
    assert [(r.model, r.kv, r.depth, r.sparse, r.budget) for r in rows] == [
        (bench.SYNTH_MODEL, "f16", 524288, False, 0), (bench.SYNTH_MODEL, "f16", 524288, True, 32 * 128)]
    (c,) = bench.ratios(rows)
    assert c["ratio"] == pytest.approx(5.0)


def test_sparse_row_without_dense_has_no_ratio() -> None:
    rows = bench.parse_llama_bench([_rec(4096, 1, 10.0)], "m")
    assert bench.ratios(rows)[0]["ratio"] is None
    assert "| – |" in bench.markdown_table(rows)


@pytest.mark.parametrize("wtype", ["f32", "f16", "q4_0"])
def test_write_llama_gguf_roundtrip(tmp_path: Path, wtype: str) -> None:
    pytest.importorskip("numpy")
    try:
        gguf = import_gguf(None)
    except ImportError:
        pytest.skip("no gguf-py")
    shape = LlamaShape(n_layer=2, n_embd=256, n_head=2, n_head_kv=1, n_ff=512, n_vocab=300)
    path = write_llama_gguf(tmp_path / "m.gguf", shape, wtype, seed=1)
    reader = gguf.GGUFReader(str(path))
    names = {t.name: t for t in reader.tensors}
    assert len(names) == 3 + 9 * 2
    k = names["blk.0.attn_k.weight"]
    assert [int(x) for x in k.shape] == [256, 128]  # ne0 = n_embd, ne1 = n_embd_kv
    assert reader.fields["llama.attention.head_count_kv"].parts[-1][0] == 1
    # deterministic: same seed, same bytes
    again = write_llama_gguf(tmp_path / "m2.gguf", shape, wtype, seed=1)
    assert path.read_bytes() == again.read_bytes()


def test_bench_report_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from opencoti_patch.cli import cli

    logs = tmp_path / "log"
    logs.mkdir()
    (logs / "bench-f16.log").write_text(json.dumps([_rec(131072, 0, 100.0), _rec(131072, 1, 250.0)]))
    (logs / "test-fill.log").write_text("not json")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["bench", "report", str(logs), "--out-dir", str(out), "--name", "x"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "x.json").read_text())
    assert data[0]["ratio"] == pytest.approx(2.5)
    assert "**2.50×**" in (out / "x-table.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(cli, ["bench", "report", str(empty), "--out-dir", str(out)])
    assert res.exit_code != 0 and "no llama-bench results" in res.output
    # without --out-dir: the project's docs/results, wherever it is run from
    root = tmp_path / "proj"
    (root / "patches").mkdir(parents=True)
    runner = CliRunner(env={"OPENCOTI_ROOT": str(root)})
    res = runner.invoke(cli, ["bench", "report", str(logs), "--name", "y"])
    assert res.exit_code == 0, res.output
    assert (root / "docs" / "results" / "y.json").is_file()
