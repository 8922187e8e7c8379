"""Unit tests for the benchmark packer/report and the random GGUF writer (no GPU needed)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from opencoti_patch.lab import bench
from opencoti_patch.verify.synth_gguf import LlamaShape, import_gguf, write_llama_gguf


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


def test_automatic_block_size_counts_128_token_blocks_and_says_auto() -> None:
    """llama-bench's -sab 0 (the default): the budget is top-k x 128 tokens (what the tree selects, in blocks
    of 32 under 1024 tokens), labelled "auto", a row apart from an explicit 128."""
    auto5 = dict(_rec(131072, 1, 190.0, topk=5), sparse_attn_block_size=0)
    auto32 = dict(_rec(131072, 1, 181.0), sparse_attn_block_size=0)
    rows = bench.parse_llama_bench([_rec(131072, 0, 95.0), _rec(131072, 1, 180.0), auto5, auto32], "8b")
    assert sorted(r.budget for r in rows if r.sparse) == [640, 4096, 4096]
    table = bench.markdown_table(rows)
    assert "| 640 (5 x auto) | 190.0 |" in table and "| 4096 (32 x auto) | 181.0 |" in table
    assert "| 4096 (32 x 128) | 180.0 |" in table


def test_longctx_reports_pair_by_name(tmp_path: Path) -> None:
    """h200.sh `longctx`: harness JSONs named longctx-KV-DEPTH-dense / -kK-bB[-SCORE] become 8b-synth rows
    (decode_tps; no score: `max`, what those runs ran); a report whose depth disagrees with its name, one
    without a timed step and other files are left out."""
    res = tmp_path / "log"
    res.mkdir()

    def js(name: str, depth: int, tps: float) -> None:
        (res / f"{name}.json").write_text(json.dumps({"synthetic_depth": depth, "decode_tps": tps}))

    js("longctx-f16-524288-dense", 524288, 40.0)
    js("longctx-f16-524288-k32-b128", 524288, 200.0)
    js("longctx-q8_0-1048576-dense", 1048576, 0.0)        # no timed step
    js("longctx-q8_0-1048576-k32-b128", 131072, 90.0)     # not the depth its name says
    js("longctx-f16-524288-dense-profile", 524288, 1.0)   # the tracer's profile, not a harness report
    js("longctx-f16-524288-k32-b128-maxmean", 524288, 160.0)  # the score, as the stage names it now
    js("longctx-f16-524288-k32-b128-bogus", 524288, 1.0)  # not a score
    rows = sorted(bench.load_results(res), key=bench.BenchRow.order)
    assert [(r.model, r.kv, r.depth, r.sparse, r.budget, r.score) for r in rows] == [
        (bench.SYNTH_MODEL, "f16", 524288, False, 0, "max"),
        (bench.SYNTH_MODEL, "f16", 524288, True, 32 * 128, "max"),
        (bench.SYNTH_MODEL, "f16", 524288, True, 32 * 128, "maxmean")]
    ratios = bench.ratios(rows)
    assert [c["ratio"] for c in ratios] == [pytest.approx(5.0), pytest.approx(4.0)]
    assert "| 4096 (32 x 128, maxmean) | 160.0 |" in bench.markdown_table(rows)


def test_sparse_row_without_dense_has_no_ratio() -> None:
    rows = bench.parse_llama_bench([_rec(4096, 1, 10.0)], "m")
    assert bench.ratios(rows)[0]["ratio"] is None
    assert "| – |" in bench.markdown_table(rows)


def _log(path: Path, *recs: dict) -> None:
    """A llama-bench -o json log (with log lines around the array, as the device writes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("main: llama-bench\n" + json.dumps(list(recs)) + "\nllama_perf: done\n")


def _sadt(depth: int, sa: int, tps: float, dense_last: int, block: int = 128, topk: int = 32) -> dict:
    rec = _rec(depth, sa, tps, topk=topk)
    return dict(rec, sparse_attn_block_size=block, sparse_attn_dense_last=dense_last)


def test_two_runs_in_one_folder_pair_with_their_own_dense(tmp_path: Path) -> None:
    """Two llama-bench logs of one machine, both with dense and sparse at 131072: each sparse row's ratio is
    against its own log's dense (the last dense row read used to win for both)."""
    _log(tmp_path / "bench-f16.log", _rec(131072, 0, 100.0), _rec(131072, 1, 250.0))
    _log(tmp_path / "bench-q8.log", _rec(131072, 0, 50.0), _rec(131072, 1, 200.0))
    rows = bench.load_results(tmp_path)
    assert sorted({(r.run, r.dense_last) for r in rows}) == [("bench-f16", None), ("bench-q8", None)]
    cs = bench.ratios(rows)
    assert [(c["run"], c["dense_tps"], c["ratio"], c["dense_run"], c["dense_note"]) for c in cs] == [
        ("bench-f16", 100.0, pytest.approx(2.5), "bench-f16", None),
        ("bench-q8", 50.0, pytest.approx(4.0), "bench-q8", None)]
    table = bench.markdown_table(rows)
    assert "| bench-f16 | 8b | f16 | 131072 | 100.0 | 4096 (32 x 128) | 250.0 | **2.50×** |" in table
    assert "| bench-q8 | 8b | f16 | 131072 | 50.0 | 4096 (32 x 128) | 200.0 | **4.00×** |" in table
    assert "dense-last" not in table and "†" not in table


def test_sadt_rows_pair_dense_last_to_dense_last(tmp_path: Path) -> None:
    """llama-bench -sa 0,1 -sadt 0,1: dense is measured at each dense_last; a sparse row pairs with the dense
    row of its own dense_last, and the table shows a dense-last column."""
    _log(tmp_path / "bench-sadt" / "bench-f16.log",
         _sadt(131072, 1, 184.0, 1), _sadt(131072, 0, 95.8, 0), _sadt(131072, 1, 189.3, 0),
         _sadt(131072, 0, 97.2, 1))
    rows = bench.load_results(tmp_path)
    cs = bench.ratios(rows)
    assert [(c["run"], c["dense_last"], c["dense_tps"], c["sparse_tps"]) for c in cs] == [
        ("bench-sadt/bench-f16", 0, 95.8, 189.3), ("bench-sadt/bench-f16", 1, 97.2, 184.0)]
    assert [c["ratio"] for c in cs] == [pytest.approx(189.3 / 95.8), pytest.approx(184.0 / 97.2)]
    table = bench.markdown_table(rows)
    assert "| budget (tokens: top-k x block) | dense-last | sparse t/s |" in table
    assert ("| bench-sadt/bench-f16 | 8b | f16 | 131072 | 95.8 | 4096 (32 x 128) | 0 | 189.3 | **1.98×** |"
            in table)
    assert "| 97.2 | 4096 (32 x 128) | 1 | 184.0 | **1.89×** |" in table


def test_sparse_only_log_takes_the_sibling_dense_with_a_footnote(tmp_path: Path) -> None:
    """A device layout: bench-b32.log has sparse rows only; its dense is bench-f16.log's of the same folder
    (94.2), marked, never the later -sadt run's in bench-sadt/ (97.2)."""
    _log(tmp_path / "bench-b32.log", _sadt(131072, 1, 175.3, 1, block=32, topk=128))
    _log(tmp_path / "bench-f16.log", _sadt(131072, 0, 94.2, 1), _sadt(131072, 1, 177.4, 1))
    _log(tmp_path / "bench-sadt" / "bench-f16.log", _sadt(131072, 0, 95.8, 0), _sadt(131072, 0, 97.2, 1),
         _sadt(131072, 1, 189.3, 0), _sadt(131072, 1, 184.0, 1))
    cs = {(c["run"], c["dense_last"]): c for c in bench.ratios(bench.load_results(tmp_path))}
    b32 = cs[("bench-b32", 1)]
    assert (b32["dense_tps"], b32["dense_run"]) == (94.2, "bench-f16")
    assert b32["ratio"] == pytest.approx(175.3 / 94.2)
    assert cs[("bench-f16", 1)]["dense_tps"] == 94.2 and cs[("bench-f16", 1)]["dense_note"] is None
    table = bench.markdown_table(bench.load_results(tmp_path))
    assert "| bench-b32 | 8b | f16 | 131072 | 94.2† | 4096 (128 x 32) | 1 | 175.3 | **1.86×** |" in table
    assert "\n† dense from bench-f16, the same folder (bench-b32 has no dense row" in table
    assert "| bench-f16 | 8b | f16 | 131072 | 94.2 |" in table


def test_logs_in_different_folders_never_pair(tmp_path: Path) -> None:
    """A sparse-only log takes no dense row of another folder (another machine), above or below it."""
    _log(tmp_path / "a" / "bench-f16.log", _rec(131072, 0, 100.0))
    _log(tmp_path / "b" / "bench-b32.log", _rec(131072, 1, 250.0))
    _log(tmp_path / "bench-top.log", _rec(131072, 1, 300.0))
    cs = bench.ratios(bench.load_results(tmp_path))
    assert [(c["run"], c["dense_tps"], c["ratio"], c["dense_run"]) for c in cs] == [
        ("b/bench-b32", None, None, None), ("bench-top", None, None, None)]
    assert "†" not in bench.markdown_table(bench.load_results(tmp_path))


def test_ambiguous_sibling_dense_is_the_first_by_run_and_named(tmp_path: Path) -> None:
    """Two sibling runs with dense at that point: the first by run name, and the footnote names the other."""
    _log(tmp_path / "bench-z.log", _rec(8192, 0, 80.0))
    _log(tmp_path / "bench-a.log", _rec(8192, 0, 100.0))
    _log(tmp_path / "bench-m.log", _rec(8192, 1, 150.0))
    (c,) = bench.ratios(bench.load_results(tmp_path))
    assert (c["dense_tps"], c["dense_run"], c["ratio"]) == (100.0, "bench-a", pytest.approx(1.5))
    assert c["dense_note"].endswith("also measured in bench-z (80.0)")
    assert "| 100.0† |" in bench.markdown_table(bench.load_results(tmp_path))


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
    # without --out-dir: the work folder's results/ (git-ignored), wherever it is run from
    root = tmp_path / "proj"
    (root / "patches").mkdir(parents=True)
    runner = CliRunner(env={"OPENCOTI_ROOT": str(root)})
    res = runner.invoke(cli, ["bench", "report", str(logs), "--name", "y"])
    assert res.exit_code == 0, res.output
    assert (root / "work" / "results" / "y.json").is_file()


def test_rows_of_another_score_or_page_size_say_so_and_pair_with_the_same_dense(tmp_path: Path) -> None:
    """llama-bench -sap 16,4 -sasc max,maxmean: four sparse rows of one budget, each labelled by how it
    ranked the blocks (the default unlabelled), each against the run's one dense row; records of older
    builds, without the fields, are the defaults."""
    sel = [dict(_rec(131072, 1, tps), sparse_attn_page_size=page, sparse_attn_score=score)
           for tps, page, score in ((250.0, 16, "max"), (240.0, 16, "maxmean"), (200.0, 4, "max"),
                                    (190.0, 4, "maxmean"), (230.0, 0, "maxmean"))]
    _log(tmp_path / "bench-f16.log", _rec(131072, 0, 100.0), *sel)
    rows = bench.load_results(tmp_path)
    assert sorted(r.selector for r in rows if r.sparse) == [
        "", "4-cell pages", "maxmean", "maxmean, 4-cell pages", "maxmean, automatic pages"]
    assert [r.selector for r in rows if not r.sparse] == [""]
    md = bench.markdown_table(rows)
    assert "| 4096 (32 x 128) | 250.0 | **2.50×** |" in md
    assert "| 4096 (32 x 128, maxmean) | 240.0 | **2.40×** |" in md
    assert "| 4096 (32 x 128, 4-cell pages) | 200.0 | **2.00×** |" in md
    assert "| 4096 (32 x 128, maxmean, 4-cell pages) | 190.0 | **1.90×** |" in md
    assert "| 4096 (32 x 128, maxmean, automatic pages) | 230.0 | **2.30×** |" in md
    assert all(c["dense_note"] is None for c in bench.ratios(rows))
