"""What a lab report says about the run that made it, and what nvidia-smi says about the GPUs: the machine
(the CPU, or the GPUs a run offloaded to), the command line (its path options as placeholders: the paths of
the machine a report was made on mean nothing to its reader), a process's GPU memory."""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys

# path options shown as placeholders in reports
PATH_OPTIONS = {"--build": "<build>", "--llama-src": "<tree>", "--model": "<model.gguf>",
                "--work-dir": "<scratch>", "--prose": "<docs-dir>", "--out-dir": "<out-dir>"}


def nvidia_smi(query: str, timeout: float = 30.0) -> list[list[str]]:
    """The rows of ``nvidia-smi --query-<query> --format=csv,noheader,nounits``, each split at its commas;
    none without nvidia-smi (or when it fails or hangs)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def machine_line(ngl: int) -> str:
    """What ran the model, for the report: the CPU, or the GPU(s) ``nvidia-smi`` names when layers are
    offloaded (a report of a GPU run must not read as a CPU run)."""
    cpu = f"{platform.machine()} CPU, {platform.system()}"
    if ngl <= 0:
        return cpu
    gpus = sorted({row[0] for row in nvidia_smi("gpu=name") if row[0]})
    return f"{', '.join(gpus) or 'GPU'} (-ngl {ngl}) on {cpu}"


def gpu_memory_mib(pid: int) -> int | None:
    """GPU memory (MiB) nvidia-smi lists for ``pid``; None without nvidia-smi or when it lists no such pid."""
    for row in nvidia_smi("compute-apps=pid,used_memory", timeout=10.0):
        if len(row) == 2 and row[0] == str(pid) and row[1].isdigit():
            return int(row[1])
    return None


def command_line(argv: list[str] | None = None) -> str:
    """The command line of this run (``sys.argv``, or ``argv``) for a report, its path options as
    placeholders."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    for i, a in enumerate(args):
        name, eq, _ = a.partition("=")
        if eq and name in PATH_OPTIONS:
            out.append(f"{name}={PATH_OPTIONS[name]}")
        elif i > 0 and args[i - 1] in PATH_OPTIONS:
            out.append(PATH_OPTIONS[args[i - 1]])
        else:
            out.append(shlex.quote(a))
    return "opencoti-patch " + " ".join(out)
