"""lab/serving/passkey.py: the passkey set through llama-server, one at a time vs several at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_llama_server import FakeLlamaServer  # noqa: E402

from opencoti_patch.lab.needle import Sample  # noqa: E402
from opencoti_patch.lab.serving import passkey as served  # noqa: E402
from opencoti_patch.lab.serving.http import HttpClientTransport  # noqa: E402

PARAGRAPHS = [f"Paragraph {i} tells of river number {i} and of the towns along its banks, one after another."
              for i in range(1000)]


def words(text: str) -> int:
    return len(text.split()) + 1


def rows(keys: dict[str, str], right: set[str]) -> list[dict[str, Any]]:
    return [{"sid": sid, "answer": key if sid in right else "11111", "correct": sid in right}
            for sid, key in keys.items()]


def prompts(n: int) -> list[served.Prompt]:
    return [served.Prompt(Sample(f"s{i}", 4096, 0, 0.5, f"{10000 + i}", 0, 0), "x", 4000) for i in range(n)]


def test_build_prompts_fit_the_context_and_hold_their_key() -> None:
    out = served.build_prompts(PARAGRAPHS, words, n_ctx=2048, count=6, seed=3, n_predict=8)
    assert len(out) == 6
    assert all(p.n_tokens <= 2048 - 8 - 8 and p.sample.key in p.text for p in out)
    assert max(p.n_tokens for p in out) > 1800  # filled, not trivially short


def test_default_variants_select_below_the_block_count() -> None:
    dense, sparse = served.default_variants(4096, 0.5)
    assert dense.args == ("--sparse-attn", "off")
    args = dict(zip(sparse.args[::2], sparse.args[1::2], strict=True))
    # 4096 tokens = 32 blocks; half attended = 16 blocks: sink 1 + recent 3 (256 tokens and the query's own
    # block) + top-k 12
    assert args["--sparse-attn"] == "on" and args["--sparse-attn-topk"] == "12"
    assert args["--sparse-attn-min-ctx"] == "1"


def test_summarize_fails_when_concurrent_loses_answers() -> None:
    ps = prompts(20)
    keys = {p.sample.sid: p.sample.key for p in ps}
    every = set(keys)
    first9 = set(list(keys)[:9])
    res = {"dense": {"sequential": rows(keys, every), "concurrent": rows(keys, every)},
           "sparse": {"sequential": rows(keys, every - {"s0"}), "concurrent": rows(keys, first9)}}
    out = served.summarize(res, ps, tolerance=1)
    assert out["verdict"] == "FAIL"
    assert out["failed"] == [
        "sparse: 9/20 correct served concurrently, 19/20 one at a time (dense: 20 and 20)"]
    assert out["table"]["sparse"]["concurrent"]["agree_dense"] == 9
    # s1..s8 right in both; s0 and s9..s19 right in one of them only
    assert out["table"]["sparse"]["concurrent"]["agree_sequential"] == 8


def test_summarize_judges_a_variant_against_the_controls_own_loss() -> None:
    """The H200 run of 2026-12-02: dense 62 -> 60, sparse 61 -> 60. Batching costs dense two answers, so
    sparse losing one passes; sparse losing four (two more than dense, tolerance 1) fails; the control never
    fails on its own loss."""
    ps = prompts(100)
    keys = {p.sample.sid: p.sample.key for p in ps}
    sids = list(keys)

    def first(n: int) -> list[dict[str, Any]]:
        return rows(keys, set(sids[:n]))

    res = {"dense": {"sequential": first(62), "concurrent": first(60)},
           "sparse": {"sequential": first(61), "concurrent": first(60)}}
    out = served.summarize(res, ps, tolerance=1)
    assert out["verdict"] == "PASS" and out["control"] == "dense"
    res["sparse"]["concurrent"] = first(57)
    out = served.summarize(res, ps, tolerance=1)
    assert out["failed"] == [
        "sparse: 57/100 correct served concurrently, 61/100 one at a time (dense: 62 and 60)"]
    res["dense"]["concurrent"] = first(30)  # a control that loses many: the variant is held to its loss
    assert served.summarize(res, ps, tolerance=1)["verdict"] == "PASS"


def test_summarize_passes_within_tolerance_and_fails_on_errors() -> None:
    ps = prompts(4)
    keys = {p.sample.sid: p.sample.key for p in ps}
    res = {"dense": {"sequential": rows(keys, set(keys)), "concurrent": rows(keys, set(keys) - {"s3"})}}
    assert served.summarize(res, ps, tolerance=1)["verdict"] == "PASS"
    assert served.summarize(res, ps, tolerance=0)["verdict"] == "FAIL"
    res["dense"]["concurrent"][0] = {"sid": "s0", "error": "HTTP 500"}
    out = served.summarize(res, ps, tolerance=4)
    assert out["failed"] == ["dense concurrent: 1 request(s) failed"]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_serve_mode_sends_every_prompt_once(concurrency: int) -> None:
    ps = served.build_prompts(PARAGRAPHS, words, n_ctx=2048, count=5, seed=1, n_predict=4)
    with FakeLlamaServer() as fake:
        out = served.serve_mode(HttpClientTransport(), fake.url, ps, concurrency=concurrency, n_predict=4)
        assert fake.calls == 5
    assert sorted(r["sid"] for r in out) == sorted(p.sample.sid for p in ps)
    assert all("error" not in r and r["correct"] is False for r in out)  # the fake answers words, no key


def test_served_command_options_reach_the_server(tmp_path: Path) -> None:
    """`selector served` takes every common selector option (it once failed on --ngl with a TypeError) and
    says what is missing: here the build's llama-server."""
    from click.testing import CliRunner  # noqa: PLC0415

    from opencoti_patch.cli.main import cli  # noqa: PLC0415

    prose_dir = tmp_path / "prose"
    prose_dir.mkdir()
    long = [" ".join(PARAGRAPHS[i:i + 3]) for i in range(0, 150, 3)]  # the corpus keeps >= 25-word paragraphs
    (prose_dir / "a.md").write_text("\n\n".join(long) + "\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = ["selector", "served", "--build", str(tmp_path / "build"), "--model", str(model),
            "--prose", str(prose_dir), "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "out")]
    res = CliRunner().invoke(cli, [*base, "--ngl", "99"])
    assert res.exit_code != 0 and "llama-server not found" in res.output, res.output
    assert not isinstance(res.exception, TypeError), res.exception
    res = CliRunner().invoke(cli, [*base, "--harness-arg=-ub"])
    assert res.exit_code == 2 and "--server-args" in res.output, res.output


def test_a_control_that_finds_nothing_proves_nothing() -> None:
    # dense 0/10 and sparse 0/10 in both modes used to PASS: no loss anywhere
    ps = prompts(10)
    keys = {p.sample.sid: p.sample.key for p in ps}
    res = {v: {m: rows(keys, set()) for m in served.MODES} for v in ("dense", "sparse")}
    out = served.summarize(res, ps, tolerance=1)
    assert out["verdict"] == "INCOMPLETE", out["failed"]
    assert any("below the floor of 25%" in f for f in out["failed"])
    lone = served.summarize({"dense": res["dense"]}, ps, tolerance=1)
    assert lone["verdict"] == "INCOMPLETE"
    res["dense"] = {m: rows(keys, set(list(keys)[:3])) for m in served.MODES}  # 3/10: above the floor
    assert served.summarize(res, ps, tolerance=1)["verdict"] == "PASS"
    assert served.summarize(res, ps, tolerance=1, min_control=0.5)["verdict"] == "INCOMPLETE"


def test_an_empty_mode_is_not_checked() -> None:
    ps = prompts(6)
    keys = {p.sample.sid: p.sample.key for p in ps}
    every = set(keys)
    res = {"dense": {"sequential": rows(keys, every), "concurrent": []},
           "sparse": {"sequential": rows(keys, every), "concurrent": []}}
    out = served.summarize(res, ps, tolerance=1)
    assert out["verdict"] == "INCOMPLETE"
    assert "dense concurrent: no request served: not checked" in out["failed"]
    # a mode that answered only some prompts fails
    res = {"dense": {"sequential": rows(keys, every), "concurrent": rows(keys, every)[:4]}}
    out = served.summarize(res, ps, tolerance=1)
    assert out["verdict"] == "FAIL" and "dense concurrent: 2 never answered" in out["failed"]


class NextKeyTransport:
    """A server that answers every request with the key of the next prompt of the set (a slot mix-up):
    served concurrently by dense and sparse alike."""

    name = "stub"

    def __init__(self, ps: list[served.Prompt], mixed: bool) -> None:
        self.by_text = {p.text: i for i, p in enumerate(ps)}
        self.keys = [p.sample.key for p in ps]
        self.mixed = mixed

    def post(self, url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]:
        i = self.by_text[body["prompt"]]
        key = self.keys[(i + 1) % len(self.keys)] if self.mixed else self.keys[i]
        return 200, json.dumps({"content": f" {key}.", "tokens_evaluated": 100}).encode()


def test_answers_with_another_requests_key_fail() -> None:
    ps = served.build_prompts(PARAGRAPHS, words, n_ctx=2048, count=8, seed=5, n_predict=4)
    res: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for v in ("dense", "sparse"):
        res[v] = {}
        for m, conc in zip(served.MODES, (1, 4), strict=True):
            stub: Any = NextKeyTransport(ps, mixed=m == "concurrent")
            res[v][m] = served.serve_mode(stub, "http://x", ps, concurrency=conc, n_predict=4)
    out = served.summarize(res, ps, tolerance=1)
    # every concurrent answer is another request's key: both lose everything, so the losses were equal
    assert out["table"]["sparse"]["concurrent"]["correct"] == 0
    assert out["verdict"] == "FAIL", out["failed"]
    assert any("8 answer(s) hold another request's key" in f for f in out["failed"])
    # a stale "correct" flag is not trusted: the answer is judged against the request's own key
    for r in res["sparse"]["concurrent"]:
        r["correct"] = True
    assert served.summarize(res, ps, tolerance=1)["table"]["sparse"]["concurrent"]["correct"] == 0
