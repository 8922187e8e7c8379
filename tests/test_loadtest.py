"""Serving load-test driver (loadtest.py) against a fake llama-server: the checks pass on a clean
server and fail on a 500, an invalid SSE chunk, a request's text fed to another, non-determinism."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from opencoti_patch.cli import cli
from opencoti_patch.errors import EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, OpencotiError
from opencoti_patch.lab.serving import http, judge, load, loadtest, schedule, server

sys.path.insert(0, str(Path(__file__).parent))
from fake_llama_server import FakeLlamaServer, Faults  # noqa: E402

WORDS = " ".join(f"word{i} lorem ipsum dolor sit amet." for i in range(6000))


def run_cli(args: list[str]) -> int:
    """``opencoti-patch lab loadtest ARGS``: its exit code."""
    return CliRunner().invoke(cli, ["lab", "loadtest", *args]).exit_code


def small_cfg(**kw: Any) -> schedule.LoadConfig:
    base: dict[str, Any] = dict(
        requests=30,
        concurrency=4,
        min_tokens=60,
        max_tokens=140,
        n_predict=5,
        seed=3,
        stream_frac=0.6,
        cancel_frac=0.4,
        cancel_chunks=(1, 2),
        v1_frac=0.4,
        repeat_frac=0.2,
        time_limit_s=60.0,
        request_timeout_s=20.0,
        rss_interval_s=0.05,
        isolated=3,
    )
    base.update(kw)
    return schedule.LoadConfig(**base)


def word_tokenizer(text: str) -> int:
    return len(text.split()) + 1


def check(summary: dict[str, Any], stage: str) -> bool | None:
    """The result of one check of a variant's summary: True, False or None (not checked)."""
    found = [c["passed"] for c in summary["checks"] if c["stage"] == stage]
    assert len(found) == 1, (stage, summary["checks"])
    return found[0]


@pytest.fixture(params=["requests", "http.client"])
def transport(request: pytest.FixtureRequest) -> http.Transport:
    return http.default_transport(str(request.param))


def run_against(faults: Faults, transport: http.Transport, **kw: Any) -> dict[str, Any]:
    with FakeLlamaServer(faults) as srv:
        res = loadtest.run_variants(
            [server.Variant("fake", ())],
            small_cfg(**kw),
            WORDS,
            transport,
            server=None,
            url=srv.url,
            log_dir=None,
            progress=lambda m: None,
        )
    summary: dict[str, Any] = res["summaries"][0]
    return summary


# --- schedule ---------------------------------------------------------------------------------------------


def test_plan_is_seeded_within_bounds_with_unique_markers_and_far_repeats() -> None:
    cfg = small_cfg(requests=40)
    a = schedule.plan(WORDS, cfg, word_tokenizer)
    b = schedule.plan(WORDS, cfg, word_tokenizer)
    assert [(j.spec.prompt, j.endpoint, j.stream, j.cancel_after, j.repeat_of) for j in a] == [
        (j.spec.prompt, j.endpoint, j.stream, j.cancel_after, j.repeat_of) for j in b
    ]
    assert len(a) == 40 and [j.pos for j in a] == list(range(40))
    uniques = [j for j in a if j.repeat_of is None]
    assert len(uniques) == 32
    assert len({j.spec.rid for j in uniques}) == 32 and len({j.spec.prompt for j in uniques}) == 32
    assert len({j.spec.fact for j in uniques}) == 32
    for j in uniques:
        assert 60 <= j.spec.n_tokens <= 140 and j.spec.n_tokens == word_tokenizer(j.spec.prompt)
        # head, the key sentence, the end line, the question, the answer's opening words
        assert schedule.MARKER_RE.findall(j.spec.prompt) == [j.spec.rid] * 5
        assert schedule.KEY_RE.findall(j.spec.prompt) == [j.spec.fact]
        assert j.cancel_after is None or j.stream
    for j in a:
        if j.repeat_of is not None:
            orig = a[j.repeat_of]
            assert orig.spec is j.spec and orig.cancel_after is None and j.cancel_after is None
            assert j.pos - orig.pos >= 2 * cfg.concurrency + 1
    assert any(j.cancel_after for j in a) and any(j.endpoint == "v1" for j in a)
    other = schedule.plan(WORDS, small_cfg(requests=40, seed=4), word_tokenizer)
    assert other[0].spec.prompt != a[0].spec.prompt


def test_shared_prefix_is_common_and_slices_differ() -> None:
    jobs = schedule.plan(
        WORDS,
        small_cfg(requests=10, shared_prefix_tokens=40, min_tokens=110, repeat_frac=0.0),
        word_tokenizer,
    )
    prefixes = [j.spec.prompt.split("\n\n=== document")[0] for j in jobs]
    # some prompts share the cached prefix, the others start cold (both kinds in the same run)
    assert set(prefixes) >= {""} and len(set(prefixes)) == 2 and 0 < prefixes.count("") < len(jobs)
    shared = next(x for x in prefixes if x)
    assert 30 <= word_tokenizer(shared) - 1 <= 40
    every = schedule.plan(WORDS, small_cfg(requests=10, shared_prefix_tokens=40, min_tokens=110,
                                           repeat_frac=0.0, shared_prefix_frac=1.0), word_tokenizer)
    assert {j.spec.prompt.split("\n\n=== document")[0] for j in every} == {shared}


def test_config_validation() -> None:
    with pytest.raises(OpencotiError):
        small_cfg(min_tokens=200, max_tokens=100).validate()
    with pytest.raises(OpencotiError):
        small_cfg(shared_prefix_tokens=50).validate()
    with pytest.raises(OpencotiError):
        server.parse_variant("no equals sign")
    assert server.parse_variant("sparse=--sparse-attn on --sparse-attn-topk 8").args == (
        "--sparse-attn",
        "on",
        "--sparse-attn-topk",
        "8",
    )


# --- checks against the fake server -------------------------------------------------------------------


def test_clean_server_passes_every_check(transport: http.Transport) -> None:
    s = run_against(Faults(chunk_delay_s=0.001), transport)
    assert s["passed"], s["checks"]
    # --url without --server-pid: memory cannot be sampled, so not PASS
    assert s["verdict"] == "INCOMPLETE" and [n.split(":")[0] for n in s["not_checked"]] == [
        "rss_flat", "gpu_mem_flat"]
    assert check(s, "key_echo") is True and s["key_echo"] == f"{s['completed']}/{s['completed']}"
    assert s["with_errors"] == 0 and s["http_5xx"] == 0 and s["skipped"] == 0
    assert s["cancelled"] > 0 and s["streamed"] > s["cancelled"] and s["v1"] > 0
    assert s["determinism"]["pairs"] > 0 and s["determinism"]["mismatches"] == 0
    assert s["isolated"]["requests"] == 4 and s["isolated"]["determinism"]["pairs"] == 1
    assert s["completed"] == s["requests"] - s["cancelled"]
    n_echo, n_final = s["echo_exact"].split("/")
    assert n_echo == n_final and int(n_final) > 0
    assert s["generated_tokens"] == 5 * s["completed"] and s["decode_tps_per_request"] == pytest.approx(500.0)


def test_a_500_fails_no_5xx(transport: http.Transport) -> None:
    s = run_against(Faults(status_500_calls={3, 7}), transport)
    assert not s["passed"] and check(s, "no_5xx") is False and s["http_5xx"] == 2
    assert "Failed to parse input" in json.dumps(s["errors_sample"])


def test_an_invalid_sse_chunk_fails_valid_json(transport: http.Transport) -> None:
    s = run_against(Faults(bad_json_chunk=True), transport)
    assert not s["passed"] and check(s, "valid_json") is False
    assert s["error_kinds"]["valid_json"] > 0
    assert check(s, "no_5xx") is True


def test_text_fed_to_another_request_fails_attribution(transport: http.Transport) -> None:
    s = run_against(Faults(leak=True), transport, concurrency=1)
    assert check(s, "attribution") is False and s["error_kinds"]["attribution"] > 0


def test_answers_without_their_key_fail_key_echo(transport: http.Transport) -> None:
    # what the real server did: no answer held any marker, so no foreign one could ever be seen
    s = run_against(Faults(no_echo=True), transport)
    assert check(s, "key_echo") is False and not s["passed"] and s["key_echo"].startswith("0/")
    assert check(s, "attribution") is True  # the foreign checks alone pass: they prove nothing here


def test_answers_that_continue_another_context_fail_key_echo(transport: http.Transport) -> None:
    # each answer repeats its own marker (the question names it) but goes on with another request's
    # context: it never read its own, and used to pass marker_echo and attribution
    s = run_against(Faults(wrong_context=True), transport, concurrency=1)
    assert check(s, "key_echo") is False and not s["passed"] and s["key_echo"].startswith("0/")
    assert check(s, "attribution") is True


def test_every_prompt_asks_for_the_key_of_its_context_last() -> None:
    jobs = schedule.plan(WORDS, small_cfg(requests=6, repeat_frac=0.0), word_tokenizer)
    for j in jobs:
        p = j.spec.prompt
        assert p.rstrip().endswith(f"The key of document {j.spec.rid} is")
        # the key sits inside the document, away from the question that asks for it
        head, end = p.index(f"=== document {j.spec.rid} ==="), p.index(f"=== end of document {j.spec.rid}")
        at = p.index(j.spec.fact)
        assert head < at < end and 0.2 < (at - head) / (end - head) < 0.8


def test_nondeterministic_output_fails_the_isolated_check(transport: http.Transport) -> None:
    s = run_against(Faults(nondeterministic=True), transport)
    assert check(s, "isolated_deterministic") is False and not s["passed"]
    assert s["determinism"]["mismatches"] > 0  # reported under load too ...
    assert all(c["stage"] != "deterministic_under_load" for c in s["checks"])  # ... a check only when strict
    strict = run_against(Faults(nondeterministic=True), transport, strict_load_determinism=True)
    assert check(strict, "deterministic_under_load") is False


def test_time_limit_skips_the_rest() -> None:
    s = run_against(Faults(chunk_delay_s=0.02), http.default_transport(), time_limit_s=0.3, isolated=0)
    assert 0 < s["skipped"] < s["requests"] and check(s, "all_started") is False


def _two_servers(salt_b: str) -> list[dict[str, Any]]:
    cfg = small_cfg(requests=16, isolated=2)
    t = http.default_transport()
    runs: dict[str, dict[str, Any]] = {}
    with FakeLlamaServer(Faults()) as a, FakeLlamaServer(Faults(salt=salt_b)) as b:
        jobs = schedule.plan(WORDS, cfg, server.server_tokenizer(t, a.url))
        for name, srv in (("dense", a), ("selectall", b)):
            runs[name] = load.run_load(t, srv.url, jobs, cfg)
            runs[name]["isolated"] = load.run_isolated(t, srv.url, jobs, cfg)
    return judge.evaluate_pairs(runs, [("selectall", "dense")], [("dense", "selectall")])


def test_expect_equal_passes_on_identical_servers_and_fails_otherwise() -> None:
    same = _two_servers("")
    assert same[0]["passed"] and same[0]["isolated"]["identical"] == 3 and same[0]["load"]["different"] == 0
    diff = _two_servers("other model")
    assert not diff[0]["passed"] and diff[0]["isolated"]["different"] == 3
    assert diff[1]["passed"] and not diff[1]["required"]  # --compare only reports


# --- RSS ------------------------------------------------------------------------------------------------


def test_rss_summary_measures_growth_after_warmup() -> None:
    samples = [(0.0, 100 * 1024, 0), (1.0, 400 * 1024, 2), (2.0, 420 * 1024, 5), (3.0, 500 * 1024, 9)]
    r = load.rss_summary(samples, warmup_done=2)
    assert r is not None
    assert (r["start_mib"], r["warm_mib"], r["peak_mib"], r["end_mib"]) == (100.0, 400.0, 500.0, 500.0)
    assert r["growth_after_warmup_mib"] == 100.0
    assert load.rss_summary([], 1) is None
    run = {"outcomes": [], "wall_s": 1.0, "rss_samples": samples, "pid": 1}
    assert check(judge.summarize("x", run, small_cfg(rss_growth_mib=64), {}), "rss_flat") is False
    assert check(judge.summarize("x", run, small_cfg(rss_growth_mib=400), {}), "rss_flat") is True


def test_rss_flat_uses_the_peak_not_the_last_sample() -> None:
    spike = [(0.0, 100 * 1024, 0), (1.0, 400 * 1024, 2), (2.0, 900 * 1024, 5), (3.0, 410 * 1024, 9)]
    r = load.rss_summary(spike, warmup_done=2)
    assert r is not None and r["growth_after_warmup_mib"] == 10.0 and r["peak_after_warmup_mib"] == 500.0
    run = {"outcomes": [], "wall_s": 1.0, "rss_samples": spike, "pid": 1}
    assert check(judge.summarize("x", run, small_cfg(rss_growth_mib=64), {}), "rss_flat") is False


def test_memory_with_only_a_start_and_an_end_sample_is_not_checked() -> None:
    # +2000 MiB between the only two samples used to pass: the end sample was its own baseline
    ends = [(0.0, 100 * 1024, 0), (9.0, 2100 * 1024, 10)]
    for warmup in (0, 1):
        r = load.rss_summary(ends, warmup_done=warmup)
        assert r is not None and "problem" in r and "peak_after_warmup_mib" not in r
    run = {"outcomes": [], "wall_s": 1.0, "rss_samples": ends, "pid": 1}
    s = judge.summarize("x", run, small_cfg(rss_growth_mib=64), {})
    assert check(s, "rss_flat") is None and s["verdict"] != "PASS"
    assert any(n.startswith("rss_flat: x: rss_flat") for n in s["not_checked"])


def test_the_load_samples_memory_throughout() -> None:
    with FakeLlamaServer(Faults()) as srv:
        cfg = small_cfg(requests=10, isolated=0, repeat_frac=0.0, rss_interval_s=60.0)  # no timer tick
        t = http.default_transport()
        jobs = schedule.plan(WORDS, cfg, server.server_tokenizer(t, srv.url))
        run = load.run_load(t, srv.url, jobs, cfg, pid=os.getpid(), gpu=lambda pid: None)
    done = [d for _, _, d in run["rss_samples"]]
    # the start, one sample after every request (the first one done is the warm-up baseline), the end
    assert len(done) == 12 and done[0] == 0 and min(done[1:]) >= 1 and done[-1] == 10, done
    r = load.rss_summary(run["rss_samples"], warmup_done=1)
    assert r is not None and r["after_warmup"] == 11 and "peak_after_warmup_mib" in r

def test_gpu_memory_is_sampled_and_checked() -> None:
    grows = iter([1000])
    with FakeLlamaServer(Faults()) as srv:
        cfg = small_cfg(requests=8, isolated=0, repeat_frac=0.0)
        t = http.default_transport()
        jobs = schedule.plan(WORDS, cfg, server.server_tokenizer(t, srv.url))
        run = load.run_load(t, srv.url, jobs, cfg, pid=os.getpid(), gpu=lambda pid: next(grows, 1400))
    s = judge.summarize("x", run, small_cfg(gpu_growth_mib=64, warmup_frac=0.0), {})
    assert s["gpu"] is not None and s["gpu"]["peak_mib"] == 1400.0
    assert check(s, "gpu_mem_flat") is False


def test_a_pid_without_gpu_samples_is_not_checked() -> None:
    # a server pid, but nvidia-smi lists no memory for it: the GPU check used to be dropped silently
    samples = [(0.0, 100 * 1024, 0), (1.0, 110 * 1024, 2), (2.0, 110 * 1024, 5), (3.0, 110 * 1024, 9)]
    run = {"outcomes": [], "wall_s": 1.0, "rss_samples": samples, "gpu_samples": [], "pid": 4242}
    s = judge.summarize("x", run, small_cfg(), {})
    assert check(s, "rss_flat") is True and check(s, "gpu_mem_flat") is None
    gpu = next(c for c in s["checks"] if c["stage"] == "gpu_mem_flat")
    assert "nvidia-smi lists no GPU memory for pid 4242" in gpu["summary"]
    assert "gpu_mem_flat: x: gpu_mem_flat" in s["not_checked"]


def test_memory_without_a_pid_is_not_checked_and_incomplete(tmp_path: Path) -> None:
    run = {"outcomes": [], "wall_s": 1.0, "rss_samples": [], "pid": None}
    s = judge.summarize("x", run, small_cfg(), {})
    assert check(s, "rss_flat") is None and check(s, "gpu_mem_flat") is None
    assert {"rss_flat", "gpu_mem_flat"} <= {n.split(":")[0] for n in s["not_checked"]}
    corpus = tmp_path / "corpus.md"
    corpus.write_text(WORDS)
    args = ["--requests", "8", "--min-tokens", "40", "--max-tokens", "80", "--n-predict", "3",
            "--isolated", "2", "--corpus", str(corpus)]
    with FakeLlamaServer(Faults()) as srv:
        assert run_cli(["--url", srv.url, *args]) == EXIT_CHECK_FAILED  # INCOMPLETE
        assert run_cli(["--url", srv.url, "--accept-not-checked", *args]) == EXIT_OK  # bare: any
        assert run_cli(["--url", srv.url, "--accept-not-checked", "gpu_mem_flat", *args]) == EXIT_CHECK_FAILED
        pid = ["--server-pid", str(os.getpid())]
        assert run_cli(["--url", srv.url, *pid, *args]) == EXIT_CHECK_FAILED  # no GPU memory of this pid
        assert run_cli(["--url", srv.url, *pid, "--accept-not-checked", "gpu_mem_flat", *args]) == EXIT_OK
        assert run_cli(["--url", srv.url, *pid, "--isolated", "0", "--accept-not-checked", "gpu_mem_flat",
                        *args[:-4], "--corpus", str(corpus)]) == EXIT_CHECK_FAILED  # no isolated reference


def test_rss_sampler_reads_proc() -> None:
    import os

    assert (load.RssSampler.read_rss_kib(os.getpid()) or 0) > 1000
    assert load.RssSampler.read_rss_kib(2**22 + 12345) is None


# --- spawning a "server" and the CLI -----------------------------------------------------------------------


@pytest.fixture
def fake_binary(tmp_path: Path) -> Iterator[Path]:
    exe = tmp_path / "llama-server"
    exe.write_text(
        f'#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / "fake_llama_server.py"} "$@"\n'
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    yield exe


def test_main_spawns_the_server_and_writes_reports(fake_binary: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.md"
    corpus.write_text(WORDS)
    out = tmp_path / "out" / "serving.json"
    md = tmp_path / "out" / "serving.md"
    code = run_cli(
        [
            "--server",
            str(fake_binary),
            "--model",
            "m.gguf",
            "--requests",
            "12",
            "--concurrency",
            "4",
            "--min-tokens",
            "40",
            "--max-tokens",
            "80",
            "--n-predict",
            "3",
            "--isolated",
            "2",
            "--corpus",
            str(corpus),
            "--variant",
            "dense=--sparse-attn off",
            "--variant",
            "selectall=--sparse-attn on --sparse-attn-topk 100000",
            "--expect-equal",
            "selectall:dense",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--accept-not-checked",
            "gpu_mem_flat",
        ]
    )
    assert code == EXIT_OK
    data = json.loads(out.read_text())
    assert data["verdict"] == "INCOMPLETE"
    assert [s["name"] for s in data["summaries"]] == ["dense", "selectall"]
    for s in data["summaries"]:
        assert [n.split(":")[0] for n in s["not_checked"]] == ["gpu_mem_flat"], s["not_checked"]
        assert check(s, "rss_flat") is True
    for s in data["summaries"]:
        assert s["rss"] and s["rss"]["samples"] >= 2 and s["server"]["alive_after"]
        assert "--port" in s["server"]["cmd"] and "127.0.0.1" in s["server"]["cmd"]
    assert "--sparse-attn-topk 100000" in data["summaries"][1]["server"]["cmd"]
    assert len(data["schedule"]) == 12 and len(data["outcomes"]["dense"]) == 12
    assert (out.parent / "dense.server.log").exists()
    assert "| requests (started / completed) |" in md.read_text()


def test_main_reports_a_server_that_dies(tmp_path: Path) -> None:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\necho 'error: unknown argument' >&2\nexit 1\n")
    exe.chmod(0o755)
    corpus = tmp_path / "corpus.md"
    corpus.write_text(WORDS)
    assert run_cli(["--server", str(exe), "--model", "m.gguf", "--corpus", str(corpus)]) == EXIT_ERROR


def test_the_command_names_every_option_and_refuses_what_cannot_run() -> None:
    r = CliRunner().invoke(cli, ["lab", "loadtest", "--help"])
    assert r.exit_code == 0 and "--sparse-attn" in r.output and "--expect-equal" in r.output
    r = CliRunner().invoke(
        cli, ["lab", "loadtest", "--url", "http://127.0.0.1:9", "--variant", "a=", "--variant", "b="]
    )
    assert r.exit_code == EXIT_ERROR and "--url runs a single variant" in r.output
