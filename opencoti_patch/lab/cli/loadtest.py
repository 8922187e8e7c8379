"""Click command ``lab loadtest``: the serving load test of llama-server (logic in
:mod:`opencoti_patch.lab.serving.loadtest`)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import click

from ...config import Settings
from ...errors import CheckFailed, OpencotiError
from ..serving.judge import STAGES, parse_pair
from ..serving.loadtest import Target, run_loadtest, write_reports
from ..serving.schedule import DEFAULT_CORPUS, LoadConfig
from ..serving.server import ServerConfig, parse_variant

_D = LoadConfig()


def _server(server: Path | None, model: Path | None, url: str | None, server_args: str, parallel: int,
            ctx: int, threads: int | None, cache_ram: int, startup_timeout: float) -> ServerConfig | None:
    """The llama-server to start per variant (None with --url)."""
    if url:
        return None
    if not server or not model:
        raise OpencotiError("--server and --model are required (or --url)")
    if not os.access(server, os.X_OK):
        raise OpencotiError(f"{server} is not an executable")
    return ServerConfig(binary=server, model=model, args=shlex.split(server_args), parallel=parallel,
                        ctx=ctx, threads=threads, cache_ram_mib=cache_ram, startup_timeout_s=startup_timeout)


@click.command("loadtest")
@click.option("--server", type=click.Path(dir_okay=False, path_type=Path),
              help="llama-server binary (started per variant).")
@click.option("--model", type=click.Path(dir_okay=False, path_type=Path),
              help="GGUF model for llama-server.")
@click.option("--url", help="Use this running server instead (one variant; RSS/GPU memory only with "
                            "--server-pid, else 'not checked').")
@click.option("--server-pid", type=int, help="pid of the --url server (its RSS and GPU memory).")
@click.option("--variant", "variants", multiple=True, metavar="NAME=ARGS",
              help="Server args of one run, e.g. 'sparse=--sparse-attn on --sparse-attn-topk 8' (repeatable; "
                   "default: dense=--sparse-attn off).")
@click.option("--server-args", default="", help="Extra args for every variant (shell-quoted string).")
@click.option("--parallel", type=int, default=4, show_default=True)
@click.option("--ctx", type=int, default=4 * 4096, show_default=True,
              help="-c (total over the parallel slots).")
@click.option("--threads", type=int, default=None, help="-t for llama-server.")
@click.option("--cache-ram", type=int, default=0, show_default=True,
              help="--cache-ram MiB (0: off, so RSS must stay flat).")
@click.option("--startup-timeout", type=float, default=600.0, show_default=True)
@click.option("--requests", type=int, default=_D.requests, show_default=True)
@click.option("--concurrency", type=int, default=_D.concurrency, show_default=True)
@click.option("--min-tokens", type=int, default=_D.min_tokens, show_default=True,
              help="Prompt length range (tokens).")
@click.option("--max-tokens", type=int, default=_D.max_tokens, show_default=True)
@click.option("--shared-prefix-tokens", type=int, default=0, show_default=True,
              help="Common corpus prefix of some prompts (prompt-cache friendly); 0 = none.")
@click.option("--shared-prefix-frac", type=float, default=_D.shared_prefix_frac, show_default=True,
              help="Share of the prompts with that prefix (the rest start cold).")
@click.option("--n-predict", type=int, default=_D.n_predict, show_default=True)
@click.option("--seed", type=int, default=_D.seed, show_default=True)
@click.option("--stream-frac", type=float, default=_D.stream_frac, show_default=True)
@click.option("--cancel-frac", type=float, default=_D.cancel_frac, show_default=True,
              help="Of the streamed requests.")
@click.option("--v1-frac", type=float, default=_D.v1_frac, show_default=True,
              help="Share sent to /v1/completions.")
@click.option("--repeat-frac", type=float, default=_D.repeat_frac, show_default=True)
@click.option("--time-limit", type=float, default=_D.time_limit_s, show_default=True,
              help="Seconds per server run.")
@click.option("--request-timeout", type=float, default=_D.request_timeout_s, show_default=True)
@click.option("--rss-growth-mib", type=float, default=_D.rss_growth_mib, show_default=True,
              help="Max RSS peak above its value after warm-up.")
@click.option("--gpu-growth-mib", type=float, default=_D.gpu_growth_mib, show_default=True,
              help="Max GPU memory peak above its value after warm-up (where nvidia-smi lists the server).")
@click.option("--min-key-echo", "--min-marker-echo", "min_key_echo", type=float, default=_D.min_key_echo,
              show_default=True,
              help="Share of finished answers that must repeat the key placed in their own context (needs a "
                   "real model and --n-predict covering the key; 0: not checked).")
@click.option("--warmup-frac", type=float, default=_D.warmup_frac, show_default=True)
@click.option("--isolated", type=int, default=_D.isolated, show_default=True,
              help="Prompts re-sent one at a time, uncached, after the load (the reference that "
                   "--expect-equal and the isolated determinism check use); 0 = none.")
@click.option("--strict-load-determinism", is_flag=True,
              help="Also require identical text under load (repeats, --expect-equal); llama-server is not "
                   "batch-invariant, so expect this to fail even for dense.")
@click.option("--corpus", multiple=True, metavar="PATH",
              help="Prose for the prompts: files, folders or glob patterns (repeatable; default "
                   f"{DEFAULT_CORPUS}).")
@click.option("--expect-equal", multiple=True, metavar="A:B",
              help="Fail unless variants A and B give identical text (e.g. selectall:dense).")
@click.option("--compare", multiple=True, metavar="A:B",
              help="Report (not require) agreement of two variants.")
@click.option("--accept-not-checked", multiple=True, is_flag=False, flag_value="all", metavar="CHECK",
              help="Exit 0 although this check could not run (repeatable; e.g. gpu_mem_flat on a CPU server; "
                   f"bare: any of {', '.join(STAGES)}); the report still says INCOMPLETE.")
@click.option("--transport", type=click.Choice(["auto", "requests", "http.client"]), default="auto",
              show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the full result as JSON.")
@click.option("--markdown", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the summary table as Markdown.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Server logs go here (default: beside --json, else none).")
def loadtest_command(server: Path | None, model: Path | None, url: str | None, server_pid: int | None,
                     variants: tuple[str, ...], server_args: str, parallel: int, ctx: int,
                     threads: int | None,
                     cache_ram: int, startup_timeout: float, requests: int, concurrency: int, min_tokens: int,
                     max_tokens: int, shared_prefix_tokens: int, shared_prefix_frac: float, n_predict: int,
                     seed: int, stream_frac: float, cancel_frac: float, v1_frac: float, repeat_frac: float,
                     time_limit: float, request_timeout: float, rss_growth_mib: float, gpu_growth_mib: float,
                     min_key_echo: float, warmup_frac: float, isolated: int, strict_load_determinism: bool,
                     corpus: tuple[str, ...], expect_equal: tuple[str, ...], compare: tuple[str, ...],
                     accept_not_checked: tuple[str, ...], transport: str, json_out: Path | None,
                     markdown: Path | None, log_dir: Path | None) -> None:
    """Bounded serving load test of llama-server, dense vs sparse: a seeded mix of long prompts (streamed or
    not, some cancelled, some repeated), each answer checked for its own request's marker and key, the
    server's memory flat. Exit 4 unless PASS (or INCOMPLETE where --accept-not-checked names what is not
    checked)."""
    cfg = LoadConfig(requests=requests, concurrency=concurrency, min_tokens=min_tokens,
                     max_tokens=max_tokens, shared_prefix_tokens=shared_prefix_tokens, n_predict=n_predict,
                     seed=seed, stream_frac=stream_frac, cancel_frac=cancel_frac, v1_frac=v1_frac,
                     repeat_frac=repeat_frac, time_limit_s=time_limit, request_timeout_s=request_timeout,
                     rss_growth_mib=rss_growth_mib, warmup_frac=warmup_frac, isolated=isolated,
                     strict_load_determinism=strict_load_determinism, shared_prefix_frac=shared_prefix_frac,
                     gpu_growth_mib=gpu_growth_mib, min_key_echo=min_key_echo)
    started = _server(server, model, url, server_args, parallel, ctx, threads, cache_ram, startup_timeout)
    result, verdict, checks = run_loadtest(
        cfg, [parse_variant(v) for v in variants], Target(started, url, server_pid),
        list(corpus) or [Settings.resolve().tree / "docs"],
        expect_equal=[parse_pair(x) for x in expect_equal], compare=[parse_pair(x) for x in compare],
        transport=transport, log_dir=log_dir or (json_out.parent if json_out else None),
        progress=lambda m: click.echo(m))
    click.echo(write_reports(result, json_out, markdown))
    why = "; ".join(f"{c.name}: {c.summary}" for c in checks if c.passed is not True)
    click.echo(verdict.verdict + (f" ({why})" if why else ""))
    if not verdict.accepts(STAGES if "all" in accept_not_checked else accept_not_checked):
        raise CheckFailed(f"load test {verdict.verdict}" + (f": {why}" if why else ""))


COMMANDS = [loadtest_command]
