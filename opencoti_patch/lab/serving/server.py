"""Local server processes: a free port on the loopback, and llama-server (:class:`ServerProcess`: started on
one, ready once ``/health`` answers, stopped), its configuration, the variants a run compares (a name and the
server arguments that make it) and its tokenizer."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import OpencotiError
from .http import Transport


@dataclass
class ServerConfig:
    binary: Path
    model: Path
    args: list[str] = field(default_factory=list)  # variant + extra args, passed through
    parallel: int = 4
    ctx: int = 4 * 4096
    threads: int | None = None
    cache_ram_mib: int = 0  # the RAM prompt cache grows by design: off so that RSS must stay flat
    startup_timeout_s: float = 600.0
    log_path: Path | None = None

    def command(self, port: int) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(self.parallel), "-fa", "on", "-c", str(self.ctx),
               "--cache-ram", str(self.cache_ram_mib)]
        if self.threads is not None:
            cmd += ["-t", str(self.threads)]
        return cmd + list(self.args)


def server_tokenizer(transport: Transport, base_url: str) -> Callable[[str], int]:
    def tokenize(text: str) -> int:
        status, data = transport.post(base_url + "/tokenize", {"content": text, "add_special": True}, 120.0)
        if status != 200:
            raise OpencotiError(f"/tokenize: HTTP {status}")
        return len(json.loads(data)["tokens"])

    return tokenize


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """llama-server on 127.0.0.1 and a free port; ready once /health answers 200."""

    def __init__(self, cfg: ServerConfig, transport: Transport) -> None:
        self.cfg, self.transport = cfg, transport
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.cmd: list[str] = []
        self._log: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for _attempt in range(3):
            self.port = free_port()
            self.cmd = self.cfg.command(self.port)
            log = self.cfg.log_path
            self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
            self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            if self._wait_ready():
                return
            code = self.proc.poll()
            self.stop()
            if code is None:
                raise OpencotiError(f"llama-server not healthy after {self.cfg.startup_timeout_s:.0f}s: "
                                    f"{shlex.join(self.cmd)}")
            if "bind" not in self.log_tail().lower():
                raise OpencotiError(f"llama-server exited with {code}: {self.log_tail()[-600:]}")
        raise OpencotiError("llama-server could not bind a free port three times")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        end = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                status, _ = self.transport.get(self.base_url + "/health", 5.0)
                if status == 200:
                    return True
            except Exception:  # connection refused while it loads
                pass
            time.sleep(0.25)
        return False

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            return self.transport.get(self.base_url + "/health", 30.0)[0] == 200
        except Exception:
            return False

    def log_tail(self, n: int = 4000) -> str:
        if not self.cfg.log_path or not self.cfg.log_path.exists():
            return ""
        return self.cfg.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(30)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        return code


@dataclass(frozen=True)
class Variant:
    """A server configuration a run compares: its name and the llama-server arguments that make it."""

    name: str
    args: tuple[str, ...]


def parse_variant(text: str) -> Variant:
    name, sep, args = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise OpencotiError(f"variant must be NAME=ARGS (e.g. 'sparse=--sparse-attn on'), got {text!r}")
    return Variant(name, tuple(shlex.split(args)))
