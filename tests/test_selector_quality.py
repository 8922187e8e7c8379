"""Unit tests of the selector-quality tools: real-prose corpus, selection recall, needle samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from opencoti_patch.errors import OpencotiError
from opencoti_patch.lab import batch, needle, prose, recall
from opencoti_patch.lab import variants as variants_mod
from opencoti_patch.lab.variants import parse_score

LONG = ("This paragraph is long enough to count as prose for the corpus, because it has well over "
        "twenty-five words in it and it ends with a full stop like a real sentence does in running text.")


def test_prose_html_and_markdown(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text(
        f"<html><nav><p>{LONG} nav</p></nav><p>{LONG}</p><pre><p>{LONG} code</p></pre>"
        f"<p>short one.</p><p>{LONG.replace('This', 'That')} &amp; more.</p></html>")
    (tmp_path / "b.md").write_text(f"# Title\n\n{LONG}\n\n```\n{LONG} fenced\n```\n\n| a | b |\n\n"
                                   f"A [link](http://x) and **bold** text {LONG}\n")
    paras = prose.load_corpus([tmp_path])
    assert paras[0] == LONG  # html first (sorted paths), nav/pre/short dropped, the md duplicate dropped
    assert paras[1].startswith("That paragraph") and paras[1].endswith("& more.")
    assert paras[2].startswith("A link and bold text This paragraph")
    assert len(paras) == 3


def test_prose_take_text_wraps_and_refuses_too_little() -> None:
    paras = ["a" * 10, "b" * 10, "c" * 10]
    assert prose.take_text(paras, 2, 20) == "c" * 10 + "\n\n" + "a" * 10
    with pytest.raises(OpencotiError, match="only"):
        prose.take_text(paras, 0, 1000)
    with pytest.raises(OpencotiError, match="not found"):
        prose.load_corpus([Path("/nonexistent/docs")])


def test_block_mass_is_a_distribution_and_causal() -> None:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1000, 16)).astype(np.float32)
    q = rng.standard_normal((4, 2, 16)).astype(np.float32)
    pos = np.array([500, 600, 998, 999])
    m = recall.block_mass(q, k, pos, 0.25, 128)
    assert np.allclose(m.sum(axis=1), 1.0, atol=1e-5)
    assert m[0, 500 // 128 + 1:].sum() == 0.0  # nothing after the query's position


def _needle_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys of noise with, in block 10, a few keys aligned with the query (a needle)."""
    rng = np.random.default_rng(seed)
    d, t = 64, 4096
    k = rng.standard_normal((t, 1, d)).astype(np.float32) * 0.5
    direction = rng.standard_normal(d).astype(np.float32)
    direction /= np.linalg.norm(direction)
    k[10 * 128 + 40:10 * 128 + 48, 0, :] += 6.0 * direction
    q = (direction[None, None, :] * 3.0 + 0.1 * rng.standard_normal((64, 4, d))).astype(np.float32)
    return q, k


def test_recall_oracle_bounds_every_selector_and_centre_score_finds_the_needle() -> None:
    q, k = _needle_case(1)
    scorers = [recall.parse_scorer(s) for s in ("minmax128", "mid32-sum", "mean32-sum")]
    res = recall.layer_recall(q, k, scale=0.5, block=128, shares=[0.25], scorers=scorers)["0.25"]
    oracle = res["values"]["oracle"]["mean"]
    for name, v in res["values"].items():
        assert v["mean"] <= oracle + 1e-9, name
    # the needle block holds most of the mass: the page-centre score keeps it, the window cannot
    assert res["values"]["mid32-sum"]["mean"] > 0.9 * oracle
    assert res["values"]["window"]["mean"] < 0.5 * oracle


def test_parse_scorer_and_budget() -> None:
    s = recall.parse_scorer("meanstd128-c2")
    assert (s.kind, s.sub, s.c) == ("meanstd", 128, 2.0)
    assert recall.parse_scorer("mid32-sum").head_reduce == "sum"
    assert recall.parse_scorer("minmax32").bytes_per_token(128) == 32.0
    with pytest.raises(OpencotiError):
        recall.parse_scorer("bogus16")
    b = recall.budget_for(8192, 0.25, 128)
    assert (b.sink_blocks, b.recent_blocks, b.top_k) == (1, 3, 12) and b.blocks * 128 == 2048
    with pytest.raises(OpencotiError, match="no top-k"):
        recall.budget_for(4096, 0.125, 128)


def test_needle_samples_avoid_sink_and_recent_blocks() -> None:
    for n_ctx in (4096, 32768):
        samples = needle.make_samples(7, n_ctx, 100, 5000)
        depths = [s.depth for s in samples]
        assert min(depths) * n_ctx > variants_mod.SINK + variants_mod.BLOCK
        assert (1 - max(depths)) * n_ctx > variants_mod.RECENT + 2 * variants_mod.BLOCK
        assert len({s.key for s in samples}) > 90
        assert {s.needle for s in samples} == set(range(len(needle.NEEDLES)))
    assert needle.make_samples(7, 4096, 10, 50) == needle.make_samples(7, 4096, 10, 50)


def test_needle_prompt_and_variants() -> None:
    paras = [f"Paragraph {i} " + LONG for i in range(50)]
    s = needle.Sample("x", 4096, 3, 0.5, "12345", 0, 1)
    p = s.prompt(paras, 5000)
    assert p.startswith(needle.HEADER) and p.endswith(needle.QUESTIONS[1])
    assert "\n\nThe pass key is 12345. Remember it." in p
    vs = variants_mod.variants_for(32768, [0.25, 0.125], [2048])
    names = [v.name for v in vs]
    assert names == ["dense", "sparse-25%", "sparse-12.5%", "sparse-2048t", "window-25%"]
    assert [v.attended_tokens(32768) for v in vs[1:]] == [8192, 4096, 2048, 8192]
    assert vs[1].variant_json()["topk"] == 64 - 1 - 3
    # at 16K the fixed 2048 tokens are the 12.5% budget: not run twice
    assert [v.name for v in variants_mod.variants_for(16384, [0.25, 0.125], [2048])][3] == "window-25%"
    assert vs[0].variant_json() == {"name": "dense", "sparse_attn": False}
    # 12.5% of 4K is only the sink + recent blocks: no top-k, not run
    assert [v.name for v in variants_mod.variants_for(4096, [0.25, 0.125], [2048])] == ["dense", "sparse-25%",
                                                                                  "window-25%"]
    # a second block size: its own variants at the same attended budgets (sink 128 and recent 256 tokens are
    # 4 and 9 blocks of 32), the window still that of the first
    vb = variants_mod.variants_for(8192, [0.25], [], blocks=[128, 32])
    assert [v.name for v in vb] == ["dense", "sparse-25%", "sparse-25%-b32", "window-25%"]
    assert [v.attended_tokens(8192) for v in vb[1:]] == [2048, 2048, 2048]
    assert vb[2].variant_json()["block_size"] == 32 and vb[2].variant_json()["topk"] == 64 - 4 - 9


def test_needle_kept_sees_the_needle_block_and_the_window_does_not() -> None:
    q, k = _needle_case(3)
    positions = np.arange(k.shape[0] - q.shape[0], k.shape[0])
    bud = recall.budget_for(k.shape[0], 0.25, 128)
    res = recall.needle_kept(q, k[:, 0, :], positions, {10}, scale=0.5, block=128, budget=bud,
                             scorers=[recall.parse_scorer("mean16")])
    assert all(res["mean16"]) and all(res["oracle"])
    assert not any(res["window"])  # block 10 of 32 is far from the recent blocks


def test_report_command_hides_machine_paths() -> None:
    from opencoti_patch.lab.runinfo import command_line

    cmd = command_line(["lab", "selector", "needles", "--build", "/opt/me/b", "--samples", "4096:16",
                        "--prose=/usr/x", "--layers", "5,11,17"])
    assert cmd == ("opencoti-patch lab selector needles --build <build> --samples 4096:16 --prose=<docs-dir> "
                   "--layers 5,11,17")


def test_split_parse_and_budget_at_a_fixed_size() -> None:
    assert recall.parse_split("512") == recall.Split(512) and recall.parse_split("512").name == "r512"
    quarter = recall.parse_split("25%")
    assert quarter.name == "r25%" and quarter.recent(2048) == 512
    for bad in ("-1", "x", "0%", "100%"):
        with pytest.raises(OpencotiError, match="recent window"):
            recall.parse_split(bad)
    # 8K at 25%: 16 blocks whatever the split; the recent window takes what the top-k gives up
    for split, (recent_b, top_k) in {"256": (3, 12), "512": (5, 10), "1024": (9, 6), "25%": (5, 10)}.items():
        b = recall.budget_for(8192, 0.25, 128, 128, recall.parse_split(split))
        assert (b.sink_blocks, b.recent_blocks, b.top_k, b.blocks) == (1, recent_b, top_k, 16), split
    with pytest.raises(OpencotiError, match="no top-k"):
        recall.budget_for(4096, 0.25, 128, 128, recall.Split(1024))


def test_head_reductions_lex_breaks_exact_ties_by_the_sum() -> None:
    s = np.array([[[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 1.0, 5.0]]])  # [N=1, G=2, nb=4]
    lex = recall.reduce_heads(s, "lex")
    assert list(np.argsort(-lex[0])) == [3, 2, 1, 0]  # 5 > (3, sum 4) > (3, sum 3) > 1
    assert list(recall.reduce_heads(s, "maxmean")[0]) == [1.5, 4.5, 5.0, 7.5]
    t = np.array([[[2.0, 2.0]]])  # a full tie: the lower block id first, as the op does
    assert list(np.argsort(-recall.reduce_heads(t, "lex")[0], kind="stable")) == [0, 1]
    assert recall.parse_scorer("mean16-lex").name == "mean16-lex"


def test_head_reduction_rr_takes_each_heads_best_in_turn() -> None:
    """rr: a quiet head still gets its own best blocks; max gives every block to the loud head."""
    s = np.array([[[9.0, 8.0, 7.0, 6.0, 0.0, 0.1], [0.0, 0.0, 0.0, 0.0, 0.3, 0.2]]])  # head 1 is quiet
    rr = recall.reduce_heads(s, "rr")[0]
    assert list(np.argsort(-rr, kind="stable"))[:4] == [0, 4, 1, 5]  # head 0's 1st, head 1's 1st, 2nd, 2nd
    assert list(np.argsort(-recall.reduce_heads(s, "max")[0], kind="stable"))[:4] == [0, 1, 2, 3]
    assert recall.parse_scorer("mean16-rr").name == "mean16-rr"


def test_recall_splits_share_one_reference_oracle() -> None:
    q, k = _needle_case(1)
    splits = [recall.Split(256), recall.Split(512), recall.Split(0, 0.25), recall.Split(2048)]
    mean16 = [recall.parse_scorer("mean16")]
    res = recall.layer_recall(q, k, scale=0.5, block=128, shares=[0.25], scorers=mean16,
                              splits=splits)["0.25"]
    vals = res["values"]
    assert "mean16@r2048" not in vals  # 2048 recent tokens leave no top-k block of a 1024-token budget
    assert set(res["budgets"]) == {"r256", "r512", "r25%"}
    ref = vals["oracle"]["mean"]
    for name, v in vals.items():
        assert v["mean"] <= ref + 1e-9, name
    assert vals["oracle@r256"]["mean"] >= vals["oracle@r512"]["mean"] - 1e-9  # a longer forced window
    assert vals["mean16@r25%"] == vals["mean16@r256"]  # a quarter of 1024 tokens is 256
    assert res["selected"]["oracle@r512"]["mean"] == pytest.approx(1.0)
    assert "window" not in res["selected"] and "oracle" not in res["selected"]
    # one split: the plain mode, the same numbers as before the option
    one = recall.layer_recall(q, k, scale=0.5, block=128, shares=[0.25], scorers=mean16,
                              recent=recall.Split(512))["0.25"]
    assert one["values"]["mean16"] == vals["mean16@r512"] and one["budget"]["recent_blocks"] == 5
    agg = recall.aggregate({"0/5": {"0.25": res}})["0.25"]
    assert set(agg["mean16@r512"]) == {"mass", "mass_p10", "of_oracle", "of_oracle_p10", "selected"}
    assert "selected" not in agg["window"]


def test_report_template_renders_an_older_report_unchanged() -> None:
    """Reports without splits (tests/data/quality-selector.json) render as they were committed."""
    from opencoti_patch.config import Settings
    from opencoti_patch.report import render

    docs = Path(__file__).resolve().parent / "data"
    data = json.loads((docs / "quality-selector.json").read_text())
    context = {"recall": None, "passkey": None, "fidelity": None, "needles": None, **data}
    out = render(Settings.resolve().templates_dirs, "quality-selector.md.j2", **context)
    assert out == (docs / "quality-selector.md").read_text()


def test_harness_command_offloads_and_passes_flags_through() -> None:
    """The device runs need -ngl 99 (the default stays CPU: -ngl 0); passed-through flags come last."""
    cpu = batch.Harness(Path("h"), Path("m.gguf"), threads=2, extra=("--swa-full",))
    cmd = cpu.command(4096, Path("r"), variants_file=Path("v"))
    assert cmd[cmd.index("-ngl") + 1] == "0" and cmd[-1] == "--swa-full"
    assert cmd[cmd.index("--variants") + 1] == "v"
    off = batch.Offload(99, ("-ub", "1024"))
    gpu = batch.Harness(Path("h"), Path("m.gguf"), threads=4, extra=("--swa-full",), offload=off)
    cmd = gpu.command(4096, Path("r"), variants_file=Path("v"))
    assert cmd[cmd.index("-ngl") + 1] == "99" and cmd[-2:] == ["-ub", "1024"]
    assert cmd[cmd.index("-c") + 1] == "4096" and cmd[cmd.index("-t") + 1] == "4"
    cfg = variants_mod.sparse_variant(4096, 1024, "sparse-25%")  # a config on the command line comes last
    assert gpu.command(4096, Path("r"), cfg)[-len(cfg.args()):] == cfg.args()


def test_passkey_samples_per_filler_text() -> None:
    """--per-doc: 100 samples over 10 filler texts; each text's depths still cover the droppable range."""
    samples = needle.make_samples(3, 16384, 100, 5000, per_doc=10)
    docs = [s.doc for s in samples]
    assert len(samples) == 100 and len(set(docs)) >= 9  # 10 draws of 5000 paragraphs
    assert all(len({s.doc for s in samples[i:i + 10]}) == 1 for i in range(0, 100, 10))
    depths = sorted(s.depth for s in samples[:10])
    assert depths[0] < 0.15 and depths[-1] > 0.85
    assert needle.make_samples(3, 16384, 100, 5000) != samples  # the default (25 a text) draws others
    with pytest.raises(OpencotiError, match="at least one sample"):
        needle.make_samples(3, 16384, 10, 5000, per_doc=0)


def _cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, object]]:
    """The selector CLI with a fake model, a small prose folder and no harness build: returns the base
    arguments and a dict where the faked runners record what they were given."""
    from opencoti_patch.lab import selector as sel

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.html").write_text("".join(f"<p>{i} {LONG}</p>" for i in range(200)))
    monkeypatch.setattr(sel.Workspace, "exe", lambda self, target: tmp_path / target)
    seen: dict[str, object] = {}

    def fake_passkey(harness: batch.Harness, *args: object, **kw: object) -> dict[str, object]:
        seen.update(kw, offload=harness.offload, threads=harness.threads)
        return {"contexts": {}, "needles": [], "questions": []}

    monkeypatch.setattr(needle, "prose_passkey", fake_passkey)
    base = ["--build", str(tmp_path / "b"), "--model", str(tmp_path / "m.gguf"), "--prose",
            str(tmp_path / "docs"), "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "out")]
    return base, seen


def test_selector_cli_passes_offload_and_per_doc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from opencoti_patch.cli import cli

    base, seen = _cli_env(tmp_path, monkeypatch)
    res = CliRunner().invoke(cli, ["selector", "passkey", *base, "--samples", "4096:4", "--ngl", "99",
                                   "--harness-arg=-ub", "--harness-arg=1024", "--per-doc", "2"])
    assert res.exit_code == 0, res.output
    assert seen["offload"] == batch.Offload(99, ("-ub", "1024")) and seen["per_doc"] == 2
    report = json.loads((tmp_path / "out" / "quality-selector.json").read_text())
    assert report["ngl"] == 99 and report["harness_args"] == ["-ub", "1024"]
    assert "-ngl 99" in report["machine"]  # a GPU run does not read as a CPU run
    res = CliRunner().invoke(cli, ["selector", "passkey", *base, "--samples", "4096:4"])
    assert seen["offload"] == batch.Offload() and seen["per_doc"] == needle.PER_DOC
    report = json.loads((tmp_path / "out" / "quality-selector.json").read_text())
    assert res.exit_code == 0 and report["ngl"] == 0 and "-ngl" not in report["machine"]


def test_recall_dump_runs_with_the_offload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recall's Q/K dump gets -ngl too (its own small parser)."""
    import subprocess

    from click.testing import CliRunner

    from opencoti_patch.cli import cli

    base, _ = _cli_env(tmp_path, monkeypatch)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stop here")

    monkeypatch.setattr(subprocess, "run", fake_run)
    res = CliRunner().invoke(cli, ["selector", "recall", *base, "--texts", "4096:1", "--layers", "5",
                                   "--ngl", "99"])
    assert res.exit_code != 0 and "stop here" in res.output
    assert calls and calls[0][calls[0].index("-ngl") + 1] == "99"


def test_an_asked_offload_must_have_happened() -> None:
    """-ngl on a build without a GPU backend runs on the CPU silently: the log must show the layers."""
    log = Path("x.log")
    gpu = "load_tensors: offloading output layer to GPU\nload_tensors: offloaded 19/19 layers to GPU\n"
    assert batch.check_offload(gpu, 99, log) == "19/19"
    assert batch.check_offload("", 0, log) is None  # CPU asked: nothing to check
    with pytest.raises(OpencotiError, match="offloaded no layers"):
        batch.check_offload("load_tensors: CPU_Mapped model buffer size = 253.3 MiB\n", 99, log)
    with pytest.raises(OpencotiError, match="offloaded 10/19"):
        batch.check_offload("load_tensors: offloaded 10/19 layers to GPU\n", 99, log)
    assert batch.check_offload("load_tensors: offloaded 10/19 layers to GPU\n", 10, log) == "10/19"


def test_passkey_harness_context_has_headroom_for_a_long_prompt(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # seen on the H200: a prompt aimed at 8K came out at 8189 tokens, + 8 generated > 8192: refused
    assert needle.harness_ctx(8192, 8) == 8192 + needle.CTX_HEADROOM
    with pytest.raises(OpencotiError, match="headroom"):
        needle.harness_ctx(8192, needle.CTX_HEADROOM)
    seen: list[int] = []

    def fake_run_variants(self: batch.Harness, reqs: list[dict[str, object]], n_ctx: int,
                          variants: list[variants_mod.AttnConfig], *a: object,
                          **kw: object) -> list[dict[str, object]]:
        seen.append(n_ctx)
        return [{"id": r["id"], "variant": v.name, "n_tokens": 8189, "text": " 12345", "ms_decode": 1.0,
                 "ms_prefill": 1.0, "n_prefill": 8188, "reused": 0} for r in reqs for v in variants]

    monkeypatch.setattr(needle, "chars_per_token", lambda *a, **k: 4.0)
    monkeypatch.setattr(batch.Harness, "run_variants", fake_run_variants)
    paras = [LONG.replace("This", f"Text {i}") * 40 for i in range(12)]
    res = needle.prose_passkey(batch.Harness(Path("harness"), Path("m.gguf")), paras, contexts={8192: 2},
                               shares=[0.25], fixed_tokens=[], seed=1, per_doc=1)
    assert seen == [8192 + needle.CTX_HEADROOM]
    assert res["contexts"]["8192"]["prompt_tokens"] == [8189, 8189]


def test_recall_block_must_divide_the_sink(tmp_path: Path) -> None:
    """`selector recall --block`: a unit that does not divide the 128-token sink is refused at once."""
    from click.testing import CliRunner  # noqa: PLC0415

    from opencoti_patch.cli.main import cli  # noqa: PLC0415

    res = CliRunner().invoke(cli, ["selector", "recall", "--build", str(tmp_path), "--layers", "5",
                                   "--block", "48"])
    assert res.exit_code == 2 and "--block" in res.output, res.output


def test_qk_dump_is_reused_only_for_the_same_text_and_arguments(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample names repeat across runs (context, sample, seed) while their texts may not (another sample
    count, other contexts drawn before): a dump is read only for the same text, model and arguments, and a
    run with other texts leaves the earlier run's dumps in place, so running the first again dumps
    nothing."""
    import sys  # noqa: PLC0415

    from opencoti_patch.lab import selector  # noqa: PLC0415

    calls = tmp_path / "calls"
    fake = tmp_path / "fake-dump"
    fake.write_text(f"#!{sys.executable}\n"
                    "import sys, pathlib, numpy as np\n"
                    "a = sys.argv; out = pathlib.Path(a[a.index('-o') + 1])\n"
                    "assert not (out / 'tokens.npy').exists()\n"
                    "np.save(out / 'tokens.npy', np.arange(3))\n"
                    f"open({str(calls)!r}, 'a').write('x')\n")
    fake.chmod(0o755)
    env = object.__new__(selector.Workspace)
    env.model = tmp_path / "m.gguf"
    monkeypatch.setattr(env, "exe", lambda target: fake, raising=False)
    base = tmp_path / "needle-c4096-000-1234"
    one = env.qk_dump(base, "prompt one", ["--layers", "5"], "dump")
    assert one.name.startswith(base.name + "-") and (one / "text.txt").read_text() == "prompt one"
    assert env.qk_dump(base, "prompt one", ["--layers", "5"], "dump") == one  # the same: reused
    assert calls.read_text() == "x"
    two = env.qk_dump(base, "prompt two", ["--layers", "5"], "dump")  # same name, another prompt
    other_layers = env.qk_dump(base, "prompt two", ["--layers", "5,11"], "dump")
    assert calls.read_text() == "xxx" and len({one, two, other_layers}) == 3
    assert (two / "text.txt").read_text() == "prompt two"
    assert env.qk_dump(base, "prompt one", ["--layers", "5"], "dump") == one  # still there
    assert calls.read_text() == "xxx"
    (two / "key.json").unlink()  # a dump interrupted before its key was written: made anew
    assert env.qk_dump(base, "prompt two", ["--layers", "5"], "dump") == two
    assert calls.read_text() == "xxxx"


def test_sum_scorer_f16_sums_round_after_every_addition() -> None:
    s = recall.parse_scorer("sum16-f16")
    assert (s.kind, s.sub, s.f16_sums, s.name) == ("sum", 16, True, "sum16-f16")
    assert s.bytes_per_token(128) == 16.0 and recall.parse_scorer("sum16").bytes_per_token(128) == 32.0
    with pytest.raises(OpencotiError):
        recall.parse_scorer("mean16-f16")  # only the sums are stored that way
    # page 0: 2048 + 1 + 1 -> 2048 in f16 with a rounding per addition (2050 rounded once);
    # page 1: one key, then no keys (NaN); page 2: no key at all
    ks = np.full((3, 3, 2), np.nan, np.float32)
    ks[0, :, 0] = [2048.0, 1.0, 1.0]
    ks[0, :, 1] = [0.1, 0.2, 0.3]
    ks[1, 0, :] = [1.5, -2.0]
    sums = recall.page_sums(ks, True)
    assert sums[0, 0] == 2048.0
    assert recall.page_sums(ks, False)[0, 0] == 2050.0
    f32 = np.float32
    ref = np.float16(f32(np.float16(f32(0.1) + f32(0.2))) + f32(0.3))  # f32 additions, each rounded to f16
    assert sums[0, 1] == f32(ref)
    assert list(sums[1]) == [1.5, -2.0] and np.isnan(sums[2]).all()


def test_variants_per_block_score() -> None:
    """--scores max,mass: each score its own sparse variants at the same budgets, the harness told the
    score."""
    vs = variants_mod.variants_for(8192, [0.25], [], scores=["max", "mass"])
    assert [v.name for v in vs] == ["dense", "sparse-25%", "sparse-25%-mass", "window-25%"]
    assert vs[1].variant_json()["score"] == "max" and vs[2].variant_json()["score"] == "mass"
    assert vs[1].variant_json()["topk"] == vs[2].variant_json()["topk"]
    # explicit, not the tree's defaults
    assert vs[1].args()[-4:] == ["--sparse-attn-score", "max", "--sparse-attn-page-size", "16"]
    assert vs[2].args()[-4:-2] == ["--sparse-attn-score", "mass"]
    assert vs[3].score == "max"  # the window ranks nothing
    both = variants_mod.variants_for(8192, [0.25], [], blocks=[128, 32], scores=["max", "mass"])
    assert [v.name for v in both][1:5] == ["sparse-25%", "sparse-25%-mass", "sparse-25%-b32",
                                           "sparse-25%-b32-mass"]
    # a first score or block size other than the defaults says so in its name (a report row named plain
    # `sparse-25%` is MAX over 128-token blocks); the window keeps its plain name
    other = variants_mod.variants_for(8192, [0.25], [2048], blocks=[32], scores=["maxmean", "maxmean-p4"])
    assert [v.name for v in other] == ["dense", "sparse-25%-b32-maxmean", "sparse-25%-b32-maxmean-p4",
                                       "window-25%"]
    fixed = variants_mod.variants_for(8192, [], [1024], scores=["maxmean"])
    assert [v.name for v in fixed] == ["dense", "sparse-1024t-maxmean", "window-1024t"]


def test_oracle_variant_is_the_mass_score_over_one_cell_pages() -> None:
    """--scores oracle: the MASS score with pages of one cell (the keys themselves), in the harness variant
    and in the llama.cpp flags alike; a plain score runs 16-cell pages, named, whatever the tree's default
    (automatic since 2026-12-06), and <score>-pauto the automatic size."""
    vs = variants_mod.variants_for(8192, [0.25], [], scores=["max", "oracle"])
    assert [v.name for v in vs] == ["dense", "sparse-25%", "sparse-25%-oracle", "window-25%"]
    assert vs[1].variant_json()["page_size"] == 16
    assert {k: vs[2].variant_json()[k] for k in ("score", "page_size")} == {"score": "mass", "page_size": 1}
    assert vs[2].args()[-4:] == ["--sparse-attn-score", "mass", "--sparse-attn-page-size", "1"]
    mass = variants_mod.variants_for(8192, [0.25], [], scores=["mass"])[1]
    assert mass.args()[-4:] == ["--sparse-attn-score", "mass", "--sparse-attn-page-size", "16"]
    auto = variants_mod.variants_for(8192, [0.25], [], scores=["maxmean-pauto"])[1]
    assert auto.name == "sparse-25%-maxmean-pauto" and auto.variant_json()["page_size"] == 0
    assert auto.args()[-2:] == ["--sparse-attn-page-size", "0"]
    p4 = variants_mod.variants_for(8192, [0.25], [], scores=["max", "max-p4"])[2]
    assert p4.name == "sparse-25%-max-p4"
    assert p4.variant_json()["page_size"] == 4 and p4.variant_json()["score"] == "max"
    assert p4.args()[-4:] == ["--sparse-attn-score", "max", "--sparse-attn-page-size", "4"]
    for bad in ("max-p0", "max-px", "sum-p4", "oracle-p2"):
        with pytest.raises(OpencotiError):
            parse_score(bad)


def test_selector_cli_refuses_an_unknown_score(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from opencoti_patch.cli.main import cli

    res = CliRunner().invoke(cli, ["selector", "passkey", "--build", str(tmp_path), "--scores", "max,best"])
    assert res.exit_code != 0 and "unknown block score 'best'" in res.output


def test_mass_score_is_the_true_block_mass_for_constant_pages() -> None:
    """mlse-norm estimates each head's softmax over the blocks from the pages' mean keys: where every key of a
    page is its mean, the estimate is exact, and the score is log(G x the head-averaged block mass)."""
    rng = np.random.default_rng(3)
    g, d, n_tok, sub, block = 4, 8, 512, 16, 128
    pages = rng.normal(size=(n_tok // sub, d)).astype(np.float32)
    k = np.repeat(pages, sub, axis=0)  # every key of a page equals the page's mean
    q = rng.normal(size=(1, g, d)).astype(np.float32) * 2
    positions = np.array([n_tok - 1])
    mass = recall.block_mass(q, k, positions, 0.5, block)[0]
    for name in ("mlse16-norm", "lse16-norm"):
        score = recall.block_scores(q, k, recall.parse_scorer(name), block, 0.5, positions)[0]
        assert np.allclose(np.exp(score), g * mass, rtol=1e-4), name
    # maxnorm divides each head by its best page instead of its sum: the same order of the blocks for one head
    one = recall.block_scores(q[:, :1], k, recall.parse_scorer("mlse16-maxnorm"), block, 0.5, positions)[0]
    true = recall.block_mass(q[:, :1], k, positions, 0.5, block)[0]
    assert np.argsort(-one).tolist() == np.argsort(-true).tolist()


def test_mass_score_weighs_each_head_by_its_own_softmax() -> None:
    """A loud head (large logits everywhere) decides the plain log-sum-exp over heads; normalised per head,
    a quiet head's one clear favourite counts as much as the loud head's."""
    d, block = 2, 16
    k = np.zeros((4 * block, d), np.float32)
    k[0:16, 0] = 1.0   # block 0: the loud head's direction, a little
    k[16:32, 0] = 1.2  # block 1: the loud head's best, by a small margin
    k[32:48, 1] = 3.0  # block 2: the quiet head's clear favourite
    q = np.array([[[20.0, 0.0], [0.0, 1.0]]], np.float32)  # head 0 loud on d0, head 1 quiet on d1
    positions = np.array([4 * block - 1])
    plain = recall.block_scores(q, k, recall.parse_scorer("mlse16"), block, 1.0, positions)[0]
    norm = recall.block_scores(q, k, recall.parse_scorer("mlse16-norm"), block, 1.0, positions)[0]
    assert np.argsort(-plain)[:2].tolist() == [1, 0]  # the loud head's two blocks first
    assert 2 in np.argsort(-norm)[:2].tolist()  # the quiet head's favourite among the first two


def test_union_scorer_takes_turns_between_rankings() -> None:
    s = recall.parse_scorer("sum16+mlse16-norm")
    assert s.kind == "union" and s.name == "sum16+mlse16-norm"
    assert [p.name for p in s.parts] == ["sum16", "mlse16-norm"]
    a = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    b = a[:, ::-1].copy()
    # a's best, b's best, a's second, b's second, ...
    assert np.argsort(-recall._union_ranks([a, b]), kind="stable")[0].tolist() == [0, 5, 1, 4, 2, 3]
    # where both agree, the union is that ranking
    assert np.argsort(-recall._union_ranks([a, a]), kind="stable")[0].tolist() == [0, 1, 2, 3, 4, 5]


def test_passkey_counts_lost_and_gained_answers_paired_with_dense(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant's report says on how many prompts it is wrong where dense is right, and the reverse."""
    paras = [LONG.replace("This", f"Text {i}") * 40 for i in range(12)]
    keys = {s.sid: s.key for s in needle.make_samples(1, 8192, 4, len(paras), 1)}
    sids = sorted(keys)
    # dense right on the first three; the sparse variant right on the first and the last
    right = {"dense": set(sids[:3]), "sparse-25%": {sids[0], sids[3]}}

    def fake_run_variants(self: batch.Harness, reqs: list[dict[str, object]], n_ctx: int,
                          variants: list[variants_mod.AttnConfig], *a: object,
                          **kw: object) -> list[dict[str, object]]:
        out = []
        for r in reqs:
            for v in variants:
                sid = str(r["id"])
                ans = keys[sid] if sid in right.get(v.name, set()) else "99999"
                out.append({"id": sid, "variant": v.name, "n_tokens": 8000, "text": f" {ans}",
                            "ms_decode": 1.0, "ms_prefill": 1.0, "n_prefill": 8000, "reused": 0})
        return out

    monkeypatch.setattr(needle, "chars_per_token", lambda *a, **k: 4.0)
    monkeypatch.setattr(batch.Harness, "run_variants", fake_run_variants)
    res = needle.prose_passkey(batch.Harness(Path("harness"), Path("m.gguf")), paras, contexts={8192: 4},
                               shares=[0.25], fixed_tokens=[], seed=1, per_doc=1)
    v = res["contexts"]["8192"]["variants"]
    assert (v["dense"]["correct"], v["dense"]["lost"], v["dense"]["gained"]) == (3, 0, 0)
    assert (v["sparse-25%"]["correct"], v["sparse-25%"]["lost"], v["sparse-25%"]["gained"]) == (2, 2, 1)
    assert (v["window-25%"]["correct"], v["window-25%"]["lost"], v["window-25%"]["gained"]) == (0, 3, 0)

    from opencoti_patch.config import Settings  # noqa: PLC0415
    from opencoti_patch.report import render  # noqa: PLC0415

    res.update(command="opencoti-patch selector passkey", n_generate=8)
    docs = Path(__file__).resolve().parent / "data"
    data = json.loads((docs / "quality-selector.json").read_text())
    context = {"recall": None, "fidelity": None, "needles": None, **data, "passkey": res}
    md = render(Settings.resolve().templates_dirs, "quality-selector.md.j2", **context)
    assert "| lost | gained |" in md
    assert "| 8192 | 4 | sparse-25% | 2048 | 2 | 1 | 2 | 1 |" in md  # agrees with dense on the first only
    # (1 - 2)/4 per prompt; variance 3/4 - 1/16 = 11/16, so 1.96*sqrt(11/64) = 0.8126 per prompt
    assert "| 8192 | 4 | sparse-25% | 2048 | 2 | 1 | 2 | 1 | -25.0 ± 81.3 |" in md
    assert "| 8192 | 4 | window-25% | 2048 | 0 | 1 | 3 | 0 | -75.0 ± 42.4 |" in md


def test_paired_change_is_the_mean_paired_difference_with_its_normal_interval() -> None:
    """10 lost, none gained, of 100: -0.1 per prompt, variance 0.1 - 0.01 = 0.09: 1.96 * 0.3/10 per prompt."""
    change, half = needle.paired_change(10, 0, 100)
    assert change == pytest.approx(-10.0) and half == pytest.approx(5.88)
    change, half = needle.paired_change(5, 5, 100)          # as many gained as lost: 0, variance 0.1
    assert change == pytest.approx(0.0) and half == pytest.approx(196 * (0.1 / 100) ** 0.5)
    assert needle.paired_change(0, 0, 50) == (0.0, 0.0)     # dense against itself
    with pytest.raises(OpencotiError, match="empty"):
        needle.paired_change(0, 0, 0)


def _passkey_result(lost: int, gained: int, samples: int) -> dict[str, object]:
    variant = {"attended_tokens": 1024, "correct": 40, "agree_dense": 90, "lost": lost, "gained": gained,
               "topk": 5, "ms_decode": 1.0, "wrong": []}
    dense = variant | {"attended_tokens": 4096, "correct": 50, "agree_dense": samples, "lost": 0,
                       "gained": 0}
    return {"kind": "passkey", "command": "opencoti-patch selector passkey", "n_generate": 8, "seed": 1,
            "shares": [0.25, 0.125], "fixed_tokens": [], "per_doc": 10, "needles": ["n"] * 3,
            "questions": ["q"] * 2,
            "header": "h", "chars_per_token": 4.0, "seconds": 1.0,
            "contexts": {"8192": {"samples": samples, "prompt_tokens": [8000, 8090], "ms_prefill": 1.0,
                                  "prefill_tokens": 4000, "seconds": 1.0,
                                  "variants": {"dense": dense, "sparse-25%": variant,
                                               "sparse-12.5%": variant | {"attended_tokens": 512},
                                               "sparse-25%-max-p4": variant | {"wrong": [{"sid": "a"}]},
                                               "window-25%": variant | {"correct": 1}}}}}


def test_selector_report_writes_the_markdown_again_with_the_change_column(tmp_path: Path) -> None:
    """A result written before the change column existed gets it from `selector report`; the JSON stays."""
    from click.testing import CliRunner  # noqa: PLC0415

    from opencoti_patch.cli import cli  # noqa: PLC0415

    result = tmp_path / "old.json"
    data = {"machine": "m", "model": "gemma.gguf", "prose": "p", "block": 128, "sink": 128, "recent": 256,
            "passkey": _passkey_result(10, 0, 100)}
    result.write_text(json.dumps(data, sort_keys=True))  # as results are written: not in the run's order
    before = result.read_bytes()
    out = CliRunner().invoke(cli, ["selector", "report", str(result)])
    assert out.exit_code == 0, out.output
    md = (tmp_path / "old.md").read_text()
    assert "| 8192 | 100 | sparse-25% | 1024 | 40 | 90 | 10 | 0 | -10.0 ± 5.9 |" in md
    assert "| 8192 | 100 | dense | 4096 | 50 | 100 | 0 | 0 | +0.0 ± 0.0 |" in md
    rows = [line.split(" | ")[2] for line in md.splitlines() if line.startswith("| 8192 | 100 |")]
    # the run's order, not the JSON's (a variant the run's parameters do not make comes last)
    assert rows == ["dense", "sparse-25%", "sparse-12.5%", "window-25%", "sparse-25%-max-p4"]
    assert "| 8192 | sparse-25%-max-p4 | sparse-25% | 0 | 1 | -1.0 ± 2.0 |" in md  # 1.96*sqrt(0.01 - 1e-4)/10
    assert result.read_bytes() == before


def test_selector_report_refuses_what_is_not_a_result(tmp_path: Path) -> None:
    from click.testing import CliRunner  # noqa: PLC0415

    from opencoti_patch.cli import cli  # noqa: PLC0415

    broken, other, partial = tmp_path / "broken.json", tmp_path / "other.json", tmp_path / "partial.json"
    broken.write_text('{"passkey": ')
    other.write_text('{"series": []}')
    partial.write_text('{"passkey": {"contexts": {"4096": {"samples": 3}}}}')
    for path, why in ((broken, "not a readable JSON result"),
                      (other, "no recall, needles, passkey or fidelity"),
                      (partial, "not a result this version can report (KeyError: 'variants')")):
        out = CliRunner().invoke(cli, ["selector", "report", str(path)])
        assert out.exit_code == 2 and why in out.output, out.output
        assert not path.with_suffix(".md").exists()


def test_variants_of_another_score_are_compared_with_the_default_on_the_same_prompts() -> None:
    """`sparse-25%-maxmean` against `sparse-25%` from the prompts each answers wrong: right on 4 where the
    default is wrong (1, 3, 4, 5), wrong on 2 where it is right (6, 7), of 10: +20 per 100."""
    def wrong(*sids: int) -> list[dict[str, object]]:
        return [{"sid": f"s{i}", "key": "1", "answer": "2", "depth": 0.5, "dense": "1"} for i in sids]

    base = {"attended_tokens": 2048, "correct": 5, "agree_dense": 9, "lost": 1, "gained": 0,
            "wrong": wrong(1, 2, 3, 4, 5)}
    other = base | {"correct": 7, "lost": 0, "gained": 2, "wrong": wrong(2, 6, 7)}
    dense = base | {"lost": 0, "gained": 0, "wrong": wrong(1, 2, 3, 4, 6)}
    passkey = {"contexts": {"8192": {"samples": 10, "variants": {"dense": dense, "sparse-25%": base,
                                                                  "sparse-25%-maxmean": other}}}}
    needle.annotate_paired(passkey)
    v = passkey["contexts"]["8192"]["variants"]
    assert "vs_default" not in v["sparse-25%"] and "vs_default" not in v["dense"]
    vs = v["sparse-25%-maxmean"]["vs_default"]
    assert (vs["name"], vs["better"], vs["worse"]) == ("sparse-25%", 4, 2)
    # (4 - 2)/10 per prompt; variance 6/10 - 0.04 = 0.56: 1.96*sqrt(0.056) = 0.4638
    assert (vs["change_per_100"], vs["change_ci95"]) == (20.0, pytest.approx(46.38, abs=0.01))
