"""Quality gates (evaluate.py): the pure parts, no build or model (real ones: tests/test_build_real.py)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from opencoti_patch.errors import CheckFailed, OpencotiError
from opencoti_patch.lab import batch, gate_report, logits, passkey, variants
from opencoti_patch.lab import evaluate as ev

FIT = ev.TokenFit(base=40, per_filler=25.0, header=20)


# --- passkey generator and parsing ----------------------------------------------------------------


def test_prompt_places_the_needle_at_the_depth_and_ends_with_the_qa_frame() -> None:
    p = ev.passkey_prompt(10, 3, "54321")
    assert p.startswith(ev.PASSKEY_HEADER)
    assert p.endswith("\nQuestion: What is the pass key?\nAnswer: The pass key is")
    before, after = p.split("The pass key is 54321. Remember it. ")
    assert before.count(ev.PASSKEY_FILLER) == 3
    assert after.count(ev.PASSKEY_FILLER) == 7
    assert ev.passkey_prompt(4, 0, "1").startswith(ev.PASSKEY_HEADER + "The pass key is 1.")
    assert ev.passkey_prompt(4, 4, "1").endswith("The pass key is 1. Remember it. " + ev.PASSKEY_QUESTION)
    with pytest.raises(ValueError):
        ev.passkey_prompt(4, 5, "1")


def test_samples_are_seeded_deterministic_and_cover_depths() -> None:
    spec = passkey.parse_samples_spec("2048:34,4096:34,8192:34")
    a = ev.passkey_samples(7, spec, FIT)
    b = ev.passkey_samples(7, spec, FIT)
    c = ev.passkey_samples(8, spec, FIT)
    assert a == b
    assert [s.key for s in a] != [s.key for s in c]
    assert len(a) == 102 and len({s.sid for s in a}) == 102
    assert len(ev.passkey_samples(7, {2048: 50, 8192: 20}, FIT)) == 70
    for n_ctx in (2048, 4096, 8192):
        group = [s for s in a if s.n_ctx == n_ctx]
        assert group[0].depth == 0.0 and group[-1].depth == 1.0
        assert all(len(s.key) == 5 and s.key.isdigit() for s in group)
        # the prompt is sized to n_ctx - margin by the token fit
        assert FIT.base + FIT.per_filler * group[0].n_filler <= n_ctx - 64
        assert FIT.base + FIT.per_filler * (group[0].n_filler + 1) > n_ctx - 64
    # prompts are a pure function of the sample
    assert a[5].prompt() == b[5].prompt() and a[5].key in a[5].prompt()


@pytest.mark.parametrize("bad", ["", "2048", "2048:x", "a:1"])
def test_samples_spec_errors(bad: str) -> None:
    with pytest.raises(OpencotiError):
        passkey.parse_samples_spec(bad)


def test_passkey_requests_go_deepest_first_with_prefix_reuse() -> None:
    group = ev.passkey_samples(1, {2048: 5}, FIT)
    reqs = ev.passkey_requests(group, 8, reuse=True)
    depths = [next(s.depth for s in group if s.sid == r["id"]) for r in reqs]
    assert depths == sorted(depths, reverse=True)
    assert all(r["reuse_prefix"] == ev.REUSE_ALIGN and r["n_generate"] == 8 for r in reqs)
    assert ev.REUSE_ALIGN % 128 == 0
    # consecutive prompts share their text up to the later (shallower) needle
    a, b = reqs[0]["text"], reqs[1]["text"]
    common = len(os.path.commonprefix([a, b]))
    assert b.index("The pass key is") >= common - len("The pass key is ")
    assert "reuse_prefix" not in ev.passkey_requests(group, 8, reuse=False)[0]


def test_token_fit_refuses_a_prompt_without_filler() -> None:
    with pytest.raises(OpencotiError):
        ev.TokenFit(base=100, per_filler=30.0).n_filler(120)


@pytest.mark.parametrize(("text", "want"), [
    (" 12345. Remember it.", "12345"),
    ("12345", "12345"),
    (" **98765**", "98765"),
    (" 1234 5", "1234"),
    (" unknown.", None),
    ("", None),
])
def test_parse_answer(text: str, want: str | None) -> None:
    assert passkey.parse_answer(text) == want


# --- configs and budgets ------------------------------------------------------------------------------


def test_budget_config_exclusive_and_inclusive() -> None:
    c = variants.budget_config(2048, 0.25)
    assert (c.topk, c.sink_blocks, c.recent_blocks) == (4, 1, 3)  # mirrors llama_sparse_attn_params
    assert c.attended_blocks(2048) == 8 and c.describe(2048)["attended_fraction"] == 0.5
    assert c.name == "sparse-25%" and c.fraction == 0.25
    assert variants.budget_config(8192, 0.5).topk == 32
    assert variants.budget_config(8192, 0.25, accounting="inclusive").topk == 16 - 4
    with pytest.raises(OpencotiError):
        variants.budget_config(2048, 0.25, accounting="inclusive")  # 4 blocks - sink - recent = 0
    args = c.args()
    assert args[:2] == ["--sparse-attn", "on"]
    assert args[args.index("--sparse-attn-topk") + 1] == "4"
    assert args[args.index("--sparse-attn-min-ctx") + 1] == "1"
    assert variants.DENSE.args() == [] and variants.DENSE.attended_blocks(2048) == 16


def test_select_all_covers_every_block() -> None:
    c = variants.select_all_config(8192)
    assert c.topk == 64 and c.min_ctx == 1 and c.attended_blocks(8192) == 64
    assert c.topk + c.sink_blocks + c.recent_blocks >= 64  # the select op's select-all rule


def test_window_baseline_attends_as_many_blocks_by_recency() -> None:
    for n_ctx, f in ((8192, 0.5), (8192, 0.25), (2048, 0.25)):
        b = variants.budget_config(n_ctx, f)
        w = variants.window_config(b, n_ctx)
        assert w.topk == 0 and w.sink == b.sink and w.name == f"window-{f * 100:g}%"
        assert w.attended_blocks(n_ctx) == b.attended_blocks(n_ctx)
        assert w.recent_blocks == b.attended_blocks(n_ctx) - b.sink_blocks
        assert "--sparse-attn-topk" in w.args() and w.args()[w.args().index("--sparse-attn-topk") + 1] == "0"


# --- KL / top-1 math -------------------------------------------------------------------------------------


def test_kl_is_zero_for_equal_logits_and_shift_invariant() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 1000)).astype(np.float32)
    assert np.all(logits.kl_divergence(x, x) == 0.0)
    assert np.allclose(logits.kl_divergence(x, x + 5.0), 0.0, atol=1e-12)


def test_kl_matches_the_definition() -> None:
    p = np.array([[0.0, 1.0, 2.0]])
    q = np.array([[2.0, 1.0, 0.0]])
    pp = np.exp(p) / np.exp(p).sum()
    qq = np.exp(q) / np.exp(q).sum()
    want = float((pp * np.log(pp / qq)).sum())
    assert logits.kl_divergence(p, q)[0] == pytest.approx(want, rel=1e-12)
    assert logits.kl_divergence(p, q)[0] > 0
    assert list(logits.top1(np.array([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]]))) == [1, 0]


def test_log_softmax_is_stable_for_large_logits() -> None:
    ls = logits.log_softmax(np.array([[1e4, 0.0, -1e4]], dtype=np.float32))
    assert np.isfinite(ls).all() and ls[0, 0] == pytest.approx(0.0)


def _dump(path: Path, rows: np.ndarray) -> Path:
    rows.astype(np.float32).tofile(path)
    return path


def test_compare_logits_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n_vocab, steps = 257, 40  # more than one chunk
    dense = rng.normal(size=(steps, n_vocab)).astype(np.float32)
    a = _dump(tmp_path / "a.f32", dense)
    same = _dump(tmp_path / "b.f32", dense.copy())
    noisy = dense + rng.normal(scale=0.5, size=dense.shape).astype(np.float32)
    c = _dump(tmp_path / "c.f32", noisy)
    targets = list(rng.integers(0, n_vocab, size=steps))

    m = logits.compare_logits(a, same, n_vocab, targets)
    assert m["identical"] and m["kl_max"] == 0.0 and m["top1_agreement"] == 1.0 and m["steps"] == steps
    assert m["nll"] == m["nll_ref"]

    m = logits.compare_logits(a, c, n_vocab, targets)
    assert not m["identical"] and m["kl_mean"] > 0 and m["kl_max"] >= m["kl_p95"] >= m["kl_median"]
    want_agree = float(np.mean(dense.argmax(1) == noisy.argmax(1)))
    assert m["top1_agreement"] == pytest.approx(want_agree)
    want_kl = logits.kl_divergence(dense, noisy).mean()
    assert m["kl_mean"] == pytest.approx(want_kl, rel=1e-9)

    with pytest.raises(OpencotiError):
        logits.compare_logits(a, _dump(tmp_path / "bad.f32", np.zeros(10)), n_vocab)


def test_check_select_all_is_a_hard_failure() -> None:
    ok = {"runs": [{"config": "select-all", "identical": True, "n_ctx": 8192, "kl_mean": 0.0,
                    "top1_agreement": 1.0, "nll_ref": 2.5}]}
    ev.check_select_all(ok)
    bad = {"runs": [{**ok["runs"][0], "identical": False, "kl_mean": 1e-9}]}
    with pytest.raises(CheckFailed):
        ev.check_select_all(bad)


def test_check_select_all_needs_its_run_and_finite_logits() -> None:
    # a fidelity result without its select-all run used to pass: the plumbing was never compared
    without = {"runs": [_fid_run(8192, "sparse-50%", 0.01, 2.1)]}
    assert ev.select_all_check(without).passed is None
    with pytest.raises(CheckFailed, match="no select-all run"):
        ev.check_select_all(without)
    nan = {"runs": [{"config": "select-all", "identical": True, "n_ctx": 8192, "kl_mean": float("nan"),
                     "top1_agreement": 1.0, "nll_ref": float("nan")}]}  # identical NaN dumps
    with pytest.raises(CheckFailed, match="not finite"):
        ev.check_select_all(nan)


# --- summary and report ----------------------------------------------------------------------------


def _fake_passkey(dense_wrong: int, sparse_wrong: int, window_right: bool = False,
                  ) -> tuple[list[ev.PasskeySample], dict[str, Any], dict, dict[str, int]]:
    """10 samples (5 per context, depths 0/25/50/75/100%); the window baseline finds only the needles in
    its recent blocks (depth 100%), unless ``window_right``."""
    samples = ev.passkey_samples(3, {2048: 5, 4096: 5}, FIT)

    def window(n: int) -> variants.AttnConfig:
        return variants.window_config(variants.budget_config(n, 0.5), n)

    names = ("dense", "sparse-50%", "sparse-25%", "window-50%")
    answers: dict[str, dict[str, str | None]] = {n: {} for n in names}
    for i, s in enumerate(samples):
        answers["dense"][s.sid] = "0" if i < dense_wrong else s.key
        answers["sparse-50%"][s.sid] = None if i < sparse_wrong else s.key
        answers["sparse-25%"][s.sid] = "1" if i % 2 else s.key
        answers["window-50%"][s.sid] = s.key if window_right or s.depth == 1.0 else "2"
    by_ctx = {f: {n: variants.budget_config(n, f).describe(n) for n in (2048, 4096)} for f in (0.25, 0.5)}
    configs = {"dense": {"sparse": False, "fraction": None, "by_ctx": {}},
               "sparse-25%": {"sparse": True, "fraction": 0.25, "by_ctx": by_ctx[0.25]},
               "sparse-50%": {"sparse": True, "fraction": 0.5, "by_ctx": by_ctx[0.5]},
               "window-50%": {"sparse": True, "fraction": 0.5, "window": True,
                              "by_ctx": {n: window(n).describe(n) for n in (2048, 4096)}}}
    n_tokens = {s.sid: round(FIT.base + FIT.per_filler * s.n_filler) for s in samples}
    return samples, answers, configs, n_tokens


def _gate(samples: list[ev.PasskeySample], answers: dict[str, Any], configs: dict,
          n_tokens: dict[str, int], min_samples: int = 6) -> dict[str, Any]:
    """The gate of the fake set (6 gated samples: the minimum lowered to them unless given)."""
    return ev.passkey_summary(samples, answers, configs, n_tokens, min_samples=min_samples)["gate"]


def test_passkey_summary_gate_and_agreement() -> None:
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=0, sparse_wrong=0)
    s = ev.passkey_summary(samples, answers, configs, n_tokens, min_samples=6)
    overall = {o["config"]: o for o in s["overall"]}
    assert overall["dense"]["correct"] == 10 and overall["window-50%"]["correct"] == 2
    assert s["gate"]["passed"] and [c["config"] for c in s["gate"]["checks"]] == ["sparse-50%"]
    check = s["gate"]["checks"][0]
    # depth 0% (sink) and 100% (recent blocks) are reported apart: 3 of 5 per context are gated
    assert (check["n"], check["n_kept"], check["n_unknown"]) == (6, 4, 0)
    assert check["window"] == "window-50%" and check["window_correct"] == 0
    # named by the share attended (top-k + sink + recent), not the top-k budget
    assert check["attended_min"] > 0.5 and check["attended_max"] <= 0.75
    assert {r["n_ctx"] for r in s["rows"]} == {2048, 4096}
    row = next(r for r in s["rows"] if r["config"] == "sparse-25%" and r["n_ctx"] == 2048)
    assert row["topk"] == 4 and row["attended_tokens"] == 1024
    assert sum(b["n"] for b in s["depth_buckets"]) == 10
    assert len(s["disagreements"]) >= 2


def test_passkey_gate_fails_when_dense_is_bad_too() -> None:
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=10, sparse_wrong=10)  # 0/10 and 0/10
    g = _gate(samples, answers, configs, n_tokens)
    assert not g["passed"] and "dense itself only 0/6" in g["checks"][0]["reasons"][0]
    assert g["verdict"] == "INCOMPLETE"  # the control proved nothing


def test_passkey_gate_needs_the_minimum_sample_count() -> None:
    # one gated sample (or six) used to be enough for a PASS
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=0, sparse_wrong=0)
    assert _gate(samples, answers, configs, n_tokens)["verdict"] == "PASS"  # minimum lowered to the 6
    g = _gate(samples, answers, configs, n_tokens, min_samples=ev.MIN_GATE_SAMPLES)
    assert g["verdict"] == "INCOMPLETE" and not g["passed"] and g["min_samples"] == 20
    assert "only 6 gated samples" in g["checks"][0]["reasons"][0]
    one = [s for s in samples if s.depth == 0.5][:1]
    g1 = _gate(one, answers, configs, n_tokens, min_samples=ev.MIN_GATE_SAMPLES)
    assert g1["checks"][0]["n"] == 1 and g1["verdict"] == "INCOMPLETE"
    with pytest.raises(CheckFailed, match="INCOMPLETE.*only 1 gated sample"):
        ev.check_gates({"passkey": {"summary": {"gate": g1}}})
    # few samples still FAIL on a failure (sparse behind dense)
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=0, sparse_wrong=3)
    assert _gate(samples, answers, configs, n_tokens, min_samples=20)["verdict"] == "FAIL"


def test_check_gates_with_no_gate_is_incomplete() -> None:
    with pytest.raises(CheckFailed, match="INCOMPLETE: no gate ran"):
        ev.check_gates({})
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=0, sparse_wrong=0)
    del answers["sparse-50%"], configs["sparse-50%"]  # no sparse config at the gate budget
    g = _gate(samples, answers, configs, n_tokens)
    assert g["checks"] == [] and g["verdict"] == "INCOMPLETE"
    with pytest.raises(CheckFailed, match="INCOMPLETE.*no sparse run at the gate budget"):
        ev.check_gates({"passkey": {"summary": {"gate": g}}})
    good = _gate(*_fake_passkey(dense_wrong=0, sparse_wrong=0))
    assert ev.check_gates({"passkey": {"summary": {"gate": good}}}).verdict == "PASS"


def test_passkey_gate_fails_when_sparse_lags_dense() -> None:
    samples, answers, configs, n_tokens = _fake_passkey(dense_wrong=0, sparse_wrong=3)  # 2 gated wrong
    g = _gate(samples, answers, configs, n_tokens)
    assert not g["passed"] and "slack 1" in g["checks"][0]["reasons"][0]


def test_passkey_gate_fails_when_the_window_does_as_well() -> None:
    samples, answers, configs, n_tokens = _fake_passkey(0, 0, window_right=True)
    g = _gate(samples, answers, configs, n_tokens)
    assert not g["passed"] and "does not beat the window" in g["checks"][0]["reasons"][0]
    del answers["window-50%"], configs["window-50%"]
    g = _gate(samples, answers, configs, n_tokens)
    assert not g["passed"] and g["checks"][0]["reasons"] == ["no window baseline at this budget"]


def test_passkey_gate_fails_when_every_needle_is_always_attended() -> None:
    samples, answers, configs, n_tokens = _fake_passkey(0, 0)
    edge = [s for s in samples if s.depth in (0.0, 1.0)]  # sink or recent blocks only
    g = _gate(edge, answers, configs, n_tokens)
    assert not g["passed"] and g["checks"][0]["n_kept"] == 4 and g["verdict"] == "INCOMPLETE"
    assert "no sample with the needle outside" in g["checks"][0]["reasons"][0]
    # an unknown needle position (an old token fit) is never counted as gated
    unknown = [ev.PasskeySample(s.sid, s.n_ctx, s.depth, s.key, s.n_filler) for s in samples]
    assert not _gate(unknown, answers, configs, n_tokens)["passed"]


def test_needle_in_kept_blocks() -> None:
    cfg = variants.budget_config(4096, 0.5).describe(4096)  # sink 1 block, recent 3 blocks of 128
    assert ev.needle_in_kept_blocks(100, 4000, cfg)  # sink
    assert not ev.needle_in_kept_blocks(2000, 4000, cfg)
    recent_start = ((4000 - 1) // 128 - 3 + 1) * 128
    assert ev.needle_in_kept_blocks(recent_start - ev.NEEDLE_SPAN, 4000, cfg)
    assert not ev.needle_in_kept_blocks(recent_start - ev.NEEDLE_SPAN - 2 * ev.NEEDLE_SLACK, 4000, cfg)


def _fid_run(n_ctx: int, name: str, kl: float, nll: float, steps: int = 256) -> dict[str, Any]:
    budget = variants.budget_config(n_ctx, 0.5)
    cfg = variants.window_config(budget, n_ctx) if name.startswith("window") else budget
    return {"n_ctx": n_ctx, "config": name, "kl_mean": kl, "nll": nll, "nll_ref": 2.0, "steps": steps,
            "cfg": cfg.describe(n_ctx)}


def test_fidelity_gate_needs_the_selector_to_beat_the_window() -> None:
    good = [_fid_run(8192, "sparse-50%", 0.01, 2.1), _fid_run(8192, "window-50%", 0.02, 2.2)]
    assert ev.fidelity_gate(good)["passed"]
    ahead = [_fid_run(8192, "sparse-50%", 0.03, 2.3), _fid_run(8192, "window-50%", 0.02, 2.2)]
    g = ev.fidelity_gate(ahead)  # the recorded case: the window ahead on KL and NLL
    assert not g["passed"] and len(g["checks"][0]["reasons"]) == 2
    assert not ev.fidelity_gate(good[:1])["passed"]  # no window run
    assert not ev.fidelity_gate([])["passed"]  # no sparse run at the gate budget
    select_all = {"config": "select-all", "identical": True, "n_ctx": 8192, "kl_mean": 0.0,
                  "top1_agreement": 1.0, "nll_ref": 2.0}
    with pytest.raises(CheckFailed, match="window"):
        ev.check_gates({"fidelity": {"runs": [*ahead, select_all], "gate": g, "select_all_identical": True}})
    ok = {"runs": [*good, select_all], "gate": ev.fidelity_gate(good)}
    assert ev.check_gates({"fidelity": ok}).verdict == "PASS"
    with pytest.raises(CheckFailed, match="no select-all run"):  # the gate alone is not enough
        ev.check_gates({"fidelity": {**ok, "runs": good}})


def test_fidelity_gate_fails_on_nan_and_needs_the_minimum_steps() -> None:
    nan = [_fid_run(8192, "sparse-50%", 0.01, float("nan")), _fid_run(8192, "window-50%", 0.02, 2.2)]
    g = ev.fidelity_gate(nan)  # a NaN NLL compared False with everything and passed
    assert g["verdict"] == "FAIL" and "not finite: nll" in g["checks"][0]["reasons"][0]
    g = ev.fidelity_gate([_fid_run(8192, "sparse-50%", 0.01, 2.1),
                          _fid_run(8192, "window-50%", 0.02, float("inf"))])
    assert g["verdict"] == "FAIL" and "window nll" in g["checks"][0]["reasons"][0]
    short = [_fid_run(8192, "sparse-50%", 0.01, 2.1, steps=16), _fid_run(8192, "window-50%", 0.02, 2.2, 16)]
    g = ev.fidelity_gate(short)
    assert g["verdict"] == "INCOMPLETE" and "only 16 decode steps" in g["checks"][0]["reasons"][0]
    assert ev.fidelity_gate(short, min_samples=16)["verdict"] == "PASS"


def test_report_renders_and_json_roundtrips(tmp_path: Path) -> None:
    samples, answers, configs, n_tokens = _fake_passkey(1, 1)
    summary = ev.passkey_summary(samples, answers, configs, n_tokens)
    summary["disagreements"][0]["texts"] = {"dense": " 0.\n", "sparse-50%": " a key"}
    passkey = {"seed": 3, "per_ctx": {2048: 5, 4096: 5}, "n_samples": 10, "fractions": [0.25, 0.5],
               "accounting": "exclusive",
               "n_generate": 8, "token_fit": {"base": 40, "per_filler": 25.0},
               "prompt_tokens": {2048: {"min": 1980, "max": 1984}, 4096: {"min": 4020, "max": 4030}},
               "frame": {"header": ev.PASSKEY_HEADER, "filler": ev.PASSKEY_FILLER,
                         "needle": ev.PASSKEY_NEEDLE, "question": ev.PASSKEY_QUESTION},
               "configs": configs, "summary": summary, "timings": [{"n_ctx": 2048, "config": "dense",
                                                                     "seconds": 1.0}],
               "select_nodes_per_step": {"dense": [0.0], "sparse-50%": [3.0]}, "seconds": 12.0}
    run = {"n_ctx": 8192, "n_prefill": 7872, "config": "select-all", "steps": 256, "kl_mean": 0.0,
           "kl_median": 0.0, "kl_p95": 0.0, "kl_max": 0.0, "top1_agreement": 1.0, "top1_disagreements": 0,
           "identical": True, "nll_ref": 2.5, "nll": 2.5,
           "cfg": variants.select_all_config(8192).describe(8192)}
    fidelity = {"steps": 256, "fractions": [0.25, 0.5], "accounting": "exclusive", "docs_dir": "/d",
                "runs": [run], "timings": [], "seconds": 3.0, "select_all_identical": True}
    meta = {"model": "m.gguf", "cli": ["opencoti-patch eval all"]}
    data = gate_report.merge_results(tmp_path / "r.json",
                                     {"passkey": passkey, "fidelity": fidelity, "meta": meta})
    md = gate_report.render_report(gate_report.default_template_dirs(), data)
    assert "## Passkey retrieval" in md and "## Decode fidelity" in md and "**PASS**" in md
    assert "| 2048 | 1980–1984 | sparse-25% | 4 | 1024 (50%) |" in md
    assert "opencoti-patch eval all" in md
    assert "sparse-50%: ` a key`" in md and "dense: ` 0.\\n`" in md
    # a later gate run merges into the same JSON
    data = gate_report.merge_results(tmp_path / "r.json", {"fidelity": {**fidelity, "steps": 300}})
    assert data["passkey"]["n_samples"] == 10 and data["fidelity"]["steps"] == 300
    only_fid = gate_report.render_report(gate_report.default_template_dirs(),
                                         {"fidelity": fidelity, "meta": {}})
    assert "## Passkey retrieval" not in only_fid


# --- the harness protocol, with a stand-in executable -------------------------------------------------------

FAKE = r'''#!{python}
import json, sys
args = sys.argv[1:]
reqs = [json.loads(l) for l in open(args[args.index("--batch") + 1]) if l.strip()]
sparse = "--sparse-attn" in args
window = "--sparse-attn-topk" in args and args[args.index("--sparse-attn-topk") + 1] == "0"
for r in reqs:
    n_tok = len(r["text"].split())
    if r.get("tokenize_only"):
        print(json.dumps({{"id": r["id"], "n_tokens": n_tok}})); continue
    steps = 1 + max(0, r.get("n_generate", 0) - 1)
    key = r["text"].split("The pass key is ")[1].split(".")[0]
    answer = "0" if window else key  # a stand-in window baseline never finds the needle
    print(json.dumps({{"id": r["id"], "n_tokens": n_tok, "text": " " + answer + ".", "decode_steps": steps,
                      "select_nodes": 3 * steps if sparse else 0, "select_nodes_prefill": 0,
                      "ms_prefill": 1.0, "ms_decode": 1.0, "n_vocab": 10}}), flush=True)
'''


def _fake_exe(tmp_path: Path) -> Path:
    exe = tmp_path / "fake-harness"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_run_passkey_with_a_stand_in_harness(tmp_path: Path) -> None:
    h = batch.Harness(exe=_fake_exe(tmp_path), model=tmp_path / "m.gguf", log_dir=tmp_path / "logs")
    out = ev.gate_passkey(h, seed=1, per_ctx={2048: 4}, fractions=[0.25, 0.5], accounting="exclusive",
                         show_progress=False, min_samples=2)
    assert out["n_samples"] == 4 and out["summary"]["gate"]["passed"]
    assert {o["config"]: o["correct"] for o in out["summary"]["overall"]} == {
        "dense": 4, "sparse-25%": 4, "sparse-50%": 4, "window-25%": 0, "window-50%": 0}
    assert out["token_fit"]["header"] > 0 and out["summary"]["gate"]["checks"][0]["n"] == 2
    per_step = out["select_nodes_per_step"]
    assert per_step["sparse-50%"] == [3.0] and per_step["dense"] == [0.0]
    assert any("--sparse-attn-topk 4" in c for c in h.commands)
    json.dumps(gate_report._jsonable(out))


def test_finished_runs_are_cached_and_resumed(tmp_path: Path) -> None:
    exe = _fake_exe(tmp_path)
    h = batch.Harness(exe=exe, model=tmp_path / "m.gguf", cache_dir=tmp_path / "cache")
    req = [{"id": "x", "text": ev.passkey_prompt(3, 1, "12345"), "n_generate": 4}]
    first = h.run(req, 2048, variants.DENSE, "dense")
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    seen: list[dict[str, Any]] = []
    exe_mtime = exe.stat().st_mtime_ns
    exe.write_text("#!/bin/sh\nexit 9\n")  # would fail if run again ...
    os.utime(exe, ns=(exe_mtime, exe_mtime))  # ... but the same binary (path + mtime) hits the cache
    again = h.run(req, 2048, variants.DENSE, "dense", seen.append)
    assert again.results == first.results and seen == first.results
    with pytest.raises(OpencotiError):  # other flags: a new run
        h.run(req, 4096, variants.DENSE, "dense")


def test_a_sparse_run_without_select_nodes_is_an_error(tmp_path: Path) -> None:
    exe = _fake_exe(tmp_path)
    exe.write_text(exe.read_text().replace("3 * steps if sparse else 0", "0"))
    h = batch.Harness(exe=exe, model=tmp_path / "m.gguf")
    req = [{"id": "x", "text": ev.passkey_prompt(3, 1, "12345"), "n_generate": 4}]
    h.run(req, 2048, variants.DENSE, "dense")
    with pytest.raises(CheckFailed, match="not active"):
        h.run(req, 2048, variants.budget_config(2048, 0.5), "sparse")


def test_a_failing_harness_reports_its_stderr(tmp_path: Path) -> None:
    exe = tmp_path / "bad"
    exe.write_text("#!/bin/sh\necho 'error: boom' >&2\nexit 3\n")
    exe.chmod(0o755)
    h = batch.Harness(exe=exe, model=tmp_path / "m.gguf")
    with pytest.raises(OpencotiError, match="boom"):
        h.run([{"id": "x", "text": "t"}], 512, variants.DENSE, "x")


def test_a_crash_backtrace_on_stdout_is_reported(tmp_path: Path) -> None:
    exe = tmp_path / "crash"
    exe.write_text("#!/bin/sh\necho '[Thread debugging using libthread_db enabled]'\necho 'GGML_ASSERT' >&2\n"
                   "exit 134\n")
    exe.chmod(0o755)
    h = batch.Harness(exe=exe, model=tmp_path / "m.gguf")
    with pytest.raises(OpencotiError, match="(?s)exited 134.*GGML_ASSERT.*Thread debugging"):
        h.run([{"id": "x", "text": "t"}], 512, variants.DENSE, "x")


def test_llama_arg_env_does_not_leak_into_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_SPARSE_ATTN", "on")
    monkeypatch.setenv("OTHER", "1")
    env = batch.clean_env()
    assert "LLAMA_ARG_SPARSE_ATTN" not in env and env["OTHER"] == "1"


def test_fidelity_text_is_ordered_and_cut(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("B" * 50)
    (tmp_path / "a.md").write_text("A" * 50)
    (tmp_path / "c.txt").write_text("C")
    text, used = ev.fidelity_text(tmp_path, 60)
    assert used == ["a.md", "b.md"] and text.startswith("A" * 50 + "\n\n") and len(text) == 60
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(OpencotiError):
        ev.fidelity_text(empty, 10)


# The real thing (patched build + harness + Gemma 3 270M): tests/test_build_real.py::test_eval_*
