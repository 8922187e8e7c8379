"""Real builds of the pinned llama.cpp (marked `build`; minutes on 2 cores, less with a warm ccache).

Cheap by construction: only ggml + libllama are built (the harness then uses its own small parser),
one pristine build is shared by every test (session fixture; set OPENCOTI_BUILD_TEST_ROOT to keep it
across sessions), the patched trees differ from it in one file, and ccache is on.

The pristine source: $OPENCOTI_PRISTINE (a folder), else tag `upstream` of $OPENCOTI_TREE
(default: the project's work/llama.cpp), else the pristine tree ci/test.sh fetches.
"""

from __future__ import annotations

import difflib
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from opencoti_patch.build import builder as b
from opencoti_patch.build import identical as ident
from opencoti_patch.config import Settings
from opencoti_patch.stack.series import read_series

pytestmark = pytest.mark.build

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [ROOT / "opencoti_patch" / "templates"]
TARGETS = ("ggml-base", "ggml", "ggml-cpu", "llama")


def _pristine_source() -> tuple[Path, str | None] | None:
    env = os.environ.get("OPENCOTI_PRISTINE")
    if env:
        return Path(env), None
    tree = Settings.resolve().tree  # OPENCOTI_TREE, else the project's work/llama.cpp
    if (tree / ".git").exists():
        tags = subprocess.run(["git", "-C", str(tree), "tag", "--list", "upstream", "upstream/*"],
                              capture_output=True, text=True).stdout.split()
        if tags:
            return tree, tags[0]
    pristine = ROOT / "work" / "ci" / "pristine"  # what ci/test.sh fetches
    return (pristine, None) if (pristine / "CMakeLists.txt").is_file() else None


SOURCE = _pristine_source()
needs_source = pytest.mark.skipif(SOURCE is None, reason="no pristine llama.cpp (set OPENCOTI_PRISTINE)")


@pytest.fixture(scope="session")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> ident.VerifyConfig:
    assert SOURCE is not None
    env = os.environ.get("OPENCOTI_BUILD_TEST_ROOT")
    work = Path(env).resolve() if env else tmp_path_factory.mktemp("verify")
    opts = b.BuildOptions(targets=TARGETS, optional_targets=(), jobs=2, build_commit=ident.VERIFY_STAMP)
    return ident.VerifyConfig(work=work, pristine=SOURCE, patched=SOURCE, options=opts, repro=False,
                              kv_types=("f16",), prompt_tokens=1024, decode=16, progress=False)


@pytest.fixture(scope="session")
def pristine(cfg: ident.VerifyConfig) -> b.BuildResult:
    """The one pristine build every test reuses (later verify runs find it up to date)."""
    ident.prepare_source(cfg, "pristine", *cfg.pristine)
    return ident.build_label(cfg, "pristine", cfg.options)


def _patch(src: Path, rel: str, old: str | None, new: str, tmp: Path, name: str) -> Path:
    """A -p1 diff replacing ``old`` by ``new`` (first occurrence; ``old=None``: append ``new``) in
    ``rel`` of the pristine export."""
    text = (src / rel).read_text()
    if old is None:
        changed = text + new
    else:
        assert old in text, f"{old!r} not in {rel}"
        changed = text.replace(old, new, 1)
    diff = difflib.unified_diff(text.splitlines(keepends=True), changed.splitlines(keepends=True),
                                f"a/{rel}", f"b/{rel}")
    path = tmp / name
    path.write_text(f"diff --git a/{rel} b/{rel}\n" + "".join(diff))
    return path


@needs_source
def test_not_default_off_fails_on_behaviour(cfg: ident.VerifyConfig, pristine: b.BuildResult,
                                            tmp_path: Path) -> None:
    # a constant that changes the logits: the attention scale of the llama graph
    patch = _patch(pristine.src, "src/models/llama.cpp", "1.0f/sqrtf(float(n_embd_head))",
                   "1.0001f/sqrtf(float(n_embd_head))", tmp_path, "0001-kq-scale.patch")
    data = ident.verify_identical(replace(cfg, patch_files=(patch,)), TEMPLATES, tmp_path / "report")
    checks = {c["stage"] + ":" + c["name"]: c for c in data["checks"]}
    assert data["verdict"] == "FAIL"
    binaries = checks["binaries:pristine vs patched binaries"]
    assert binaries["passed"], binaries["evidence"]  # libllama differs, and src/ feeds it: expected
    assert any("differs (expected): libllama.so <- 0001-kq-scale.patch" in e for e in binaries["evidence"])
    behaviour = checks["behaviour:feature off, KV f16, -fa on"]
    assert behaviour["passed"] is False and "logits sha256" in behaviour["summary"]
    assert any("first difference at row" in e for e in behaviour["evidence"])
    assert (tmp_path / "report" / "verify-identical.md").read_text().startswith("# verify-identical: FAIL")


@needs_source
def test_comment_only_patch_passes(cfg: ident.VerifyConfig, pristine: b.BuildResult, tmp_path: Path) -> None:
    # appended, so no line moves: not even a __LINE__ of an assert changes
    patch = _patch(pristine.src, "src/llama-graph.cpp", None, "// opencoti: a comment, nothing else\n",
                   tmp_path, "0001-comment.patch")
    data = ident.verify_identical(replace(cfg, patch_files=(patch,)), TEMPLATES, tmp_path / "report")
    assert data["verdict"] == "PASS", [(c["name"], c["summary"]) for c in data["checks"]]
    binaries = next(c for c in data["checks"] if c["stage"] == "binaries")
    assert "0 differ" in binaries["summary"]  # a trailing comment changes no byte of any DSO
    ident.raise_on_failure(data)


@needs_source
def test_rebuild_manifest_stamp_install(cfg: ident.VerifyConfig, pristine: b.BuildResult,
                                        tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-x.patch").write_text("not applied; only fingerprinted\n")
    (patches / "series").write_text("0001-x.patch\n")
    fp = b.series_fingerprint(patches)
    opts = replace(cfg.options, targets=TARGETS)
    installs = [tmp_path / "site-a", tmp_path / "site-b"]
    manifest, out_dir = b.rebuild(pristine.src, cfg.work, opts, label="rebuild", rev=None, pin="0c1e57098",
                                  patches_dir=patches, template_dirs=TEMPLATES, install_dirs=installs,
                                  progress=False)
    stamp = f"0c1e57098+{fp[:12]}"
    assert manifest["build_commit"] == stamp and manifest["series_fingerprint"] == fp
    assert manifest["series"] == ["0001-x.patch"]
    keys = {b.artifact_key(a["name"]) for a in manifest["artifacts"]}
    assert {"libggml-base.so", "libggml.so", "libggml-cpu.so", "libllama.so"} <= keys
    bin_dir = out_dir / "bin"
    for art in manifest["artifacts"]:
        assert b.sha256_file(bin_dir / art["name"]) == art["sha256"]
    # the stamp is in the binaries: ggml_commit() of libggml-base comes from the stub git
    base = next(a["name"] for a in manifest["artifacts"] if a["name"].startswith("libggml-base.so"))
    assert stamp.encode() in (bin_dir / base).read_bytes()
    assert manifest["toolchain"]["cc"] and "-DGGML_BACKEND_DL=ON" in manifest["cmake_options"]
    assert (out_dir / b.MANIFEST_MD).read_text().count("`lib") >= 4
    for d in installs:
        assert (d / "libllama.so").exists() and (d / b.MANIFEST_JSON).is_file()


@needs_source
def test_real_series_is_default_off(cfg: ident.VerifyConfig, pristine: b.BuildResult, tmp_path: Path) -> None:
    """The sparse-attention series of this repository, feature off: same logits, graph and buffers."""
    names = read_series(ROOT / "patches")
    assert names, "patches/series is empty"
    patches = tuple(ROOT / "patches" / n for n in names)
    data = ident.verify_identical(replace(cfg, patch_files=patches), TEMPLATES, tmp_path / "report")
    assert data["verdict"] == "PASS", [(c["name"], c["summary"]) for c in data["checks"] if not c["passed"]]
    behaviour = [c for c in data["checks"] if c["stage"] == "behaviour"]
    assert behaviour and all(c["passed"] for c in behaviour)


@needs_source
def test_sparse_attn_cpu_selfchecks(cfg: ident.VerifyConfig, pristine: b.BuildResult) -> None:
    """The series' own C++ tests on the CPU: the kernels against naive references (test-sparse-attn) and
    the key-bounds side-cache after KV-cache operations, select-all == dense (test-sparse-attn-kv)."""
    patches = [ROOT / "patches" / n for n in read_series(ROOT / "patches")]
    # the tests link the CPU backend directly: a non-DL build
    opts = replace(cfg.options, targets=("test-sparse-attn", "test-sparse-attn-kv"), optional_targets=(),
                   extra_cmake=("-DGGML_BACKEND_DL=OFF", "-DLLAMA_BUILD_TESTS=ON"))
    ident.prepare_source(cfg, "selfcheck", *cfg.pristine, patches=patches)
    res = ident.build_label(cfg, "selfcheck", opts)
    out = subprocess.run([str(res.bin / "test-sparse-attn")], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " 0 failed" in out.stdout + out.stderr
    # one head size keeps CI time down; all three run in the series' ctest
    kv = subprocess.run([str(res.bin / "test-sparse-attn-kv"), "hd=128"], capture_output=True, text=True,
                        timeout=1800)
    log = kv.stdout + kv.stderr
    assert kv.returncode == 0 and "all OK" in log, log[-4000:]
    assert log.count(" OK") >= 4, log[-4000:]
