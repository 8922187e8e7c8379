"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from prereq import pytest_runtest_makereport  # noqa: F401 (a hook: no skip under OPENCOTI_REQUIRE_ALL=1)
from stackutil import PIN_A, PIN_B, Project, make_sdist, upstream_toml, write_upstream


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    from click.testing import CliRunner

    up_a = write_upstream(tmp_path / "src-a")
    up_b = write_upstream(tmp_path / "src-b", drift=True)
    sha_a = make_sdist(up_a, tmp_path / "a.tar.gz")
    sha_b = make_sdist(up_b, tmp_path / "b.tar.gz", top="pkg-2.0")
    root = tmp_path / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "upstream.toml").write_text(
        upstream_toml({PIN_A: (tmp_path / "a.tar.gz", sha_a), PIN_B: (tmp_path / "b.tar.gz", sha_b)}, PIN_A)
    )
    for var in ("OPENCOTI_TREE", "OPENCOTI_WORK", "OPENCOTI_PATCHES", "OPENCOTI_SDIST", "OPENCOTI_LOCK_WAIT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENCOTI_ROOT", str(root))
    monkeypatch.setenv("OPENCOTI_CACHE", str(tmp_path / "cache"))
    return Project(root, CliRunner(), tmp_path / "a.tar.gz", sha_a, tmp_path / "b.tar.gz", sha_b)
