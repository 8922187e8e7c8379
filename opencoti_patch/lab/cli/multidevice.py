"""Click command ``lab multidevice rpc``: sparse attention with the layers split between a local device and a
llama.cpp RPC server on loopback (logic in :mod:`opencoti_patch.lab.multidevice`)."""

from __future__ import annotations

from pathlib import Path

import click

from ...config import Settings
from ...report import info
from .. import multidevice
from ..model import find_model
from ..runinfo import command_line, machine_line


@click.group("multidevice")
def multidevice_group() -> None:
    """Sparse attention with layers on several devices."""


@multidevice_group.command("rpc")
@click.option("--build", "build_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="A build of the patched tree with -DGGML_RPC=ON (bin/: ggml-rpc-server, libllama-common).")
@click.option("--llama-src", type=click.Path(file_okay=False, path_type=Path),
              help="The source of that build (headers for the harness; default: the project's tree).")
@click.option("--model", type=click.Path(dir_okay=False, path_type=Path),
              help="GGUF model (default: the Gemma 3 270M of the [model] extra).")
@click.option("--split", "split_args", default="-ngl 2", show_default=True,
              help="How the layers are split between the local device and the RPC device (llama.cpp flags; "
                   "on a CPU build the RPC device is the only offload target: -ngl N puts the last N layers "
                   "there; on a GPU build e.g. '-ngl 99 -ts 1,1').")
@click.option("--local", "local_args", default="-ngl 0", show_default=True,
              help="The same model on the local device only (the reference of the sparse run).")
@click.option("--server-device", help="ggml-rpc-server -d (e.g. CUDA0; default: the server's own default).")
@click.option("--prompt-tokens", type=int, default=2048, show_default=True)
@click.option("--decode", type=int, default=16, show_default=True,
              help="Decode steps: greedy in the first variant (local dense), fed to the others.")
@click.option("--ctx", type=int, default=4096, show_default=True)
@click.option("--topk", type=int, default=4, show_default=True, help="Top-k blocks of the sparse variant.")
@click.option("-t", "--threads", type=int, default=2, show_default=True)
@click.option("--harness-arg", "harness_args", multiple=True,
              help="More harness flags for every variant (repeatable, e.g. '-ctk q8_0 -ctv q8_0').")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Scratch folder (default: work/multidevice).")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write <name>.json and <name>.md here.")
@click.option("--name", default="multidevice-rpc", show_default=True)
def rpc_command(build_dir: Path, llama_src: Path | None, model: Path | None, split_args: str,
                local_args: str, server_device: str | None, prompt_tokens: int, decode: int, ctx: int,
                topk: int, threads: int, harness_args: tuple[str, ...], work_dir: Path | None,
                out_dir: Path | None, name: str) -> None:
    """Layers split between this machine's device and an RPC server on 127.0.0.1 (started and stopped here).

    Checks select-all = dense bitwise in the split layout, sparse split vs sparse on one device, that the
    selection runs, that each device's side-cache of key sums matches the layers its KV holds, and that sparse
    attention adds no graph split. Exit code 4 unless every check ran and passed.
    """
    settings = Settings.resolve()
    mdl = find_model(model)
    cfg = multidevice.rpc_check_config(
        build_dir, llama_src or settings.tree, mdl, work_dir or settings.work_dir / "multidevice",
        split_args=split_args, local_args=local_args, harness_args=harness_args, server_device=server_device,
        prompt_tokens=prompt_tokens, decode=decode, ctx=ctx, topk=topk, threads=threads)
    info(f"multidevice rpc: {len(multidevice.VARIANTS)} runs of {prompt_tokens} + {decode} tokens")
    result = multidevice.run_rpc_check(cfg)
    result |= {"command": command_line(), "model": mdl.name,
               "machine": machine_line(multidevice.offloaded_layers(cfg) if server_device else 0)}
    for c in result["checks"]:
        info(f"  {c['status']:<11} {c['name']}: {c['summary']}")
    if out_dir:
        path = multidevice.save(result, out_dir, name)
        info(f"wrote {path} and {path.with_suffix('.md')}")
    multidevice.raise_on_failure(result)


COMMANDS = (multidevice_group,)
