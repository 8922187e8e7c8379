"""Unit tests of the selector-quality tools: real-prose corpus, selection recall, needle samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from opencoti_patch.errors import OpencotiError
from opencoti_patch.quality import needle, prose, recall

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
        assert min(depths) * n_ctx > needle.SINK + needle.BLOCK
        assert (1 - max(depths)) * n_ctx > needle.RECENT + 2 * needle.BLOCK
        assert len({s.key for s in samples}) > 90
        assert {s.needle for s in samples} == set(range(len(needle.NEEDLES)))
    assert needle.make_samples(7, 4096, 10, 50) == needle.make_samples(7, 4096, 10, 50)


def test_needle_prompt_and_variants() -> None:
    paras = [f"Paragraph {i} " + LONG for i in range(50)]
    s = needle.Sample("x", 4096, 3, 0.5, "12345", 0, 1)
    p = s.prompt(paras, 5000)
    assert p.startswith(needle.HEADER) and p.endswith(needle.QUESTIONS[1])
    assert "\n\nThe pass key is 12345. Remember it." in p
    vs = needle.variants_for(32768, [0.25, 0.125], [2048])
    names = [v.name for v in vs]
    assert names == ["dense", "sparse-25%", "sparse-12.5%", "sparse-2048t", "window-25%"]
    assert [v.attended(32768) for v in vs[1:]] == [8192, 4096, 2048, 8192]
    assert vs[1].json()["topk"] == 64 - 1 - 3
    # at 16K the fixed 2048 tokens are the 12.5% budget: not run twice
    assert [v.name for v in needle.variants_for(16384, [0.25, 0.125], [2048])][3] == "window-25%"
    assert vs[0].json() == {"name": "dense", "sparse_attn": False}
    # 12.5% of 4K is only the sink + recent blocks: no top-k, not run
    assert [v.name for v in needle.variants_for(4096, [0.25, 0.125], [2048])] == ["dense", "sparse-25%",
                                                                                  "window-25%"]


def test_needle_kept_sees_the_needle_block_and_the_window_does_not() -> None:
    q, k = _needle_case(3)
    positions = np.arange(k.shape[0] - q.shape[0], k.shape[0])
    bud = recall.budget_for(k.shape[0], 0.25, 128)
    res = recall.needle_kept(q, k[:, 0, :], positions, {10}, scale=0.5, block=128, budget=bud,
                             scorers=[recall.parse_scorer("mean16")])
    assert all(res["mean16"]) and all(res["oracle"])
    assert not any(res["window"])  # block 10 of 32 is far from the recent blocks


def test_report_command_hides_machine_paths() -> None:
    from opencoti_patch.cli.selector import _command

    cmd = _command(["selector", "needles", "--build", "/opt/me/b", "--samples", "4096:16", "--prose=/usr/x",
                    "--layers", "5,11,17"])
    assert cmd == ("opencoti-patch selector needles --build <cpu-build> --samples 4096:16 --prose=<docs-dir> "
                   "--layers 5,11,17")
