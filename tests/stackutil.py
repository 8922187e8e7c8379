"""Helpers for the patch-stack tests: tiny synthetic upstream trees, sdists and projects."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner, Result

from opencoti_patch.cli import cli

PIN_A, PIN_B = "aaa1111", "bbb2222"
A_LINES = [f"int line_{i:02d} = {i};" for i in range(1, 41)]


def write_upstream(root: Path, drift: bool = False) -> Path:
    """A few files in the shapes that matter: ignored-but-shipped, exec, symlink, CRLF, binary."""
    root.mkdir(parents=True)
    (root / "src").mkdir()
    lines = list(A_LINES)
    if drift:  # what a newer upstream does: lines added on top, one line near the end changed
        lines = ["// new upstream header", "#include <stdio.h>", "", *lines]
        lines[-3] = "int line_38 = 3800; // changed upstream"
    (root / "src" / "a.c").write_text("\n".join(lines) + "\n")
    (root / "src" / "b.h").write_text("#pragma once\nint b(void);\n")
    (root / "README.md").write_text("# tiny upstream\n" + ("drifted\n" if drift else ""))
    (root / ".gitignore").write_text("*.gguf\nbuild/\n")
    (root / ".gitattributes").write_text("* text=auto\n*.bat text eol=crlf\n")
    (root / "models").mkdir()
    (root / "models" / "vocab.gguf").write_bytes(b"GGUF\x00\x01binary\xff")
    (root / "win.bat").write_bytes(b"@echo off\r\necho hi\r\n")
    (root / "mixed.txt").write_bytes(b"lf\ncrlf\r\n")
    (root / "scripts").mkdir()
    (root / "scripts" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "scripts" / "run.sh").chmod(0o755)
    os.symlink("README.md", root / "link.md")
    return root


def make_sdist(tree: Path, out: Path, top: str = "pkg-1.0", subdir: str = "vendor/llama.cpp",
               head: str | None = None) -> str:
    """Tar ``tree`` as ``top/subdir`` (plus the dangling .git file an sdist carries, and with
    ``head`` the submodule record ``.git/modules/<subdir>/HEAD`` naming that commit); sha256."""
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname=f"{top}/{subdir}")

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add(f"{subdir}/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n")
        add("setup.py", b"print('setup')\n")
        if head is not None:
            add(".git/HEAD", b"1652066e0af45f2313b339670ef9555e8a54e545\n")  # the package's own commit
            add(f".git/modules/{subdir}/HEAD", head.encode() + b"\n")
    return hashlib.sha256(out.read_bytes()).hexdigest()


def upstream_toml(pins: dict[str, tuple[Path, str]], default: str) -> str:
    text = f'default = "{default}"\n'
    for name, (archive, sha) in pins.items():
        text += (f'\n[pins.{name}]\ncommit = "{name}"\ndescription = "test pin {name}"\n\n'
                 f'[[pins.{name}.sources]]\nkind = "sdist"\npath = "{archive}"\nsha256 = "{sha}"\n'
                 'subdir = "vendor/llama.cpp"\n')
    return text


@dataclass
class Project:
    root: Path
    runner: CliRunner
    sdist_a: Path
    sha_a: str
    sdist_b: Path
    sha_b: str

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def tree(self) -> Path:
        return self.root / "work" / "llama.cpp"

    def run(self, *args: str, code: int | None = 0) -> Result:
        result = self.runner.invoke(cli, list(args), catch_exceptions=False)
        if code is not None:
            assert result.exit_code == code, (args, result.exit_code, result.output)
        return result

    def edit(self, rel: str, old: str, new: str) -> None:
        path = self.tree / rel
        text = path.read_text()
        assert old in text, (rel, old)
        path.write_text(text.replace(old, new, 1))

    def resolve_conflict(self, rel: str, line: str) -> None:
        """Replace the first conflict block (``<<<<<<<`` to ``>>>>>>>``) of a tree file with ``line``."""
        path = self.tree / rel
        text = path.read_text()
        start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
        end = text.index("\n", end) + 1
        path.write_text(text[:start] + line + "\n" + text[end:])

    def prepared(self) -> Project:
        self.run("prepare")
        return self


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """A local HTTP server for ``directory`` (downloads without the network); yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
