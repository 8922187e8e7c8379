"""ci/device/quality.sh: the model travels to the device in parts, one call each, and is assembled there
only when every part is in and the whole file has the MANIFEST's sha256. Also its stage table (what each
device stage runs) and the prose bundle it carries."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from opencoti_patch.lab import prose

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "device" / "quality.sh"
MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def _tree(root: Path) -> Path:
    """A working tree with only the script (the script finds .carry/ next to its ci/ folder)."""
    (root / "ci" / "device").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "ci" / "device" / "quality.sh")
    return root / "ci" / "device" / "quality.sh"


def _sh(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


@pytest.fixture()
def parts(tmp_path: Path) -> tuple[Path, bytes]:
    """A 2.5 MiB 'model' split here into 1 MiB parts (part1..part3) + MANIFEST."""
    data = os.urandom(5 * 512 * 1024)
    model = tmp_path / "m.gguf"
    model.write_bytes(data)
    script = _tree(tmp_path / "here")
    res = _sh(script, "split", MODEL=str(model), PART_MIB="1")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "here" / ".carry" / "gemma"
    assert sorted(p.name for p in out.iterdir()) == ["MANIFEST", "part1", "part2", "part3"]
    man = (out / "MANIFEST").read_text().splitlines()
    digest = hashlib.sha256(data).hexdigest()
    assert man[:3] == [f"name {MODEL_NAME}", f"size {len(data)}", f"sha256 {digest}"]
    assert [line.split()[:3] for line in man[3:]] == [
        ["part", "part1", str(1 << 20)], ["part", "part2", str(1 << 20)],
        ["part", "part3", str(len(data) - (2 << 20))]]
    return out, data


def _call(tmp_path: Path, n: int, carried: list[str], src: Path,
          gemma: Path) -> subprocess.CompletedProcess[str]:
    """One device call: a fresh copy of the tree that carries only ``carried`` (and the MANIFEST)."""
    script = _tree(tmp_path / f"call{n}")
    dst = tmp_path / f"call{n}" / ".carry" / "gemma"
    dst.mkdir(parents=True)
    for name in ["MANIFEST", *carried]:
        shutil.copy(src / name, dst / name)
    return _sh(script, "receive", OPENCOTI_GEMMA_DIR=str(gemma))


def test_receive_assembles_only_when_every_part_is_in(tmp_path: Path, parts: tuple[Path, bytes]) -> None:
    src, data = parts
    gemma = tmp_path / "device-gemma"
    res = _call(tmp_path, 1, ["part3"], src, gemma)
    assert res.returncode == 0, res.stderr
    assert "still missing: part1 part2" in res.stdout and not (gemma / MODEL_NAME).exists()
    res = _call(tmp_path, 2, ["part1"], src, gemma)
    assert "still missing: part2" in res.stdout and not (gemma / MODEL_NAME).exists()
    res = _call(tmp_path, 3, ["part2"], src, gemma)
    assert res.returncode == 0, res.stderr
    assert "assembled" in res.stdout
    assert (gemma / MODEL_NAME).read_bytes() == data
    assert not list(gemma.glob("part*"))  # the parts are dropped once the file is verified
    res = _call(tmp_path, 4, [], src, gemma)  # a later call: already complete
    assert res.returncode == 0 and "is complete" in res.stdout


def test_receive_refuses_a_corrupt_part_and_a_wrong_whole(tmp_path: Path, parts: tuple[Path, bytes]) -> None:
    src, data = parts
    gemma = tmp_path / "device-gemma"
    good = (src / "part2").read_bytes()
    bad = bytearray(good)
    bad[7] ^= 0xFF
    (src / "part2").write_bytes(bytes(bad))
    res = _call(tmp_path, 1, ["part2"], src, gemma)
    assert res.returncode != 0 and "part2 does not match" in res.stderr
    assert not (gemma / "part2").exists()
    # a part left on the device that matches in size but not in bytes: the whole file's sha256 catches it
    _call(tmp_path, 2, ["part1", "part3"], src, gemma)
    (gemma / "part2").write_bytes(bytes(bad))
    res = _call(tmp_path, 3, [], src, gemma)
    assert res.returncode != 0 and "MANIFEST says" in res.stderr and "dropped: part2 " in res.stderr
    assert not (gemma / MODEL_NAME).exists() and not (gemma / "part2").exists()
    assert (gemma / "part1").exists() and (gemma / "part3").exists()
    (src / "part2").write_bytes(good)  # carried again, right this time
    res = _call(tmp_path, 4, ["part2"], src, gemma)
    assert res.returncode == 0 and (gemma / MODEL_NAME).read_bytes() == data


def test_receive_without_a_manifest_says_what_to_carry(tmp_path: Path) -> None:
    script = _tree(tmp_path / "t")
    res = _sh(script, "receive", OPENCOTI_GEMMA_DIR=str(tmp_path / "g"))
    assert res.returncode != 0 and "carry .carry/gemma/MANIFEST" in res.stderr


def test_stage_table_budgets_and_sizes(tmp_path: Path) -> None:
    """Every device stage runs what the quality bar asks; an unknown stage is refused before anything runs."""
    script = _tree(tmp_path / "t")
    res = _sh(script, "run", "passkey-64k", OPENCOTI_QUALITY_WORK=str(tmp_path / "qw"))
    assert res.returncode != 0 and "unknown stage passkey-64k" in res.stderr
    assert not (tmp_path / "qw").exists()
    res = _sh(script, "args", OPENCOTI_DEVICE_CUDA="1")
    assert res.returncode == 0, res.stderr
    got = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert list(got) == ["passkey-4k", "passkey-8k", "fidelity", "passkey-16k", "passkey-32k", "recall"]
    for name, ctx in (("passkey-4k", 4096), ("passkey-8k", 8192), ("passkey-16k", 16384),
                      ("passkey-32k", 32768)):
        assert got[name] == f"passkey --samples {ctx}:100 --shares 0.25,0.125 --fixed 2048 --per-doc 10"
    assert got["fidelity"] == ("fidelity --contexts 8192,16384,32768 --steps 256 --texts 2 --shares 0.25 "
                               "--fixed 2048")
    assert got["recall"].startswith("recall --texts 8192:2,16384:2,32768:2 --layers 5,11,17 "
                                    "--shares 0.25,0.125 ")
    res = _sh(script, "args", "passkey-16k", OPENCOTI_DEVICE_CUDA="1", SAMPLES="7")
    assert res.stdout.strip() == ("passkey-16k: passkey --samples 16384:7 --shares 0.25,0.125 --fixed 2048 "
                                  "--per-doc 10")
    # the comparison stages: passkey-N's samples, the layer rule off / 32-token blocks beside 128
    res = _sh(script, "args", "passkey-8k-dl0", "passkey-4k-b32", "passkey-8k-b32", "passkey-16k-b32",
              "passkey-64k-b32", OPENCOTI_DEVICE_CUDA="1")
    assert res.stdout.splitlines() == [
        "passkey-8k-dl0: passkey --samples 8192:100 --shares 0.25 --fixed= --per-doc 10 "
        "--harness-arg=--sparse-attn-dense-last --harness-arg=0",
        "passkey-4k-b32: passkey --samples 4096:100 --shares 0.25 --fixed= --per-doc 10 --blocks 128,32",
        "passkey-8k-b32: passkey --samples 8192:100 --shares 0.25,0.125 --fixed= --per-doc 10 "
        "--blocks 128,32",
        "passkey-16k-b32: passkey --samples 16384:100 --shares 0.25,0.125 --fixed=2048 --per-doc 10 "
        "--blocks 128,32",
        "passkey-64k-b32: unknown"]
    # the oracle stages: MAX and the exact-mass ranking (mass over one-cell pages) side by side
    res = _sh(script, "args", "passkey-4k-oracle", "passkey-8k-oracle", "fidelity-oracle",
              OPENCOTI_DEVICE_CUDA="1")
    assert res.stdout.splitlines() == [
        "passkey-4k-oracle: passkey --samples 4096:100 --shares 0.25 --fixed= --per-doc 10 --blocks 128,32 "
        "--scores max,max-p4,oracle",
        "passkey-8k-oracle: passkey --samples 8192:100 --shares 0.25,0.125 --fixed= --per-doc 10 "
        "--blocks 128,32 --scores max,max-p4,oracle",
        "fidelity-oracle: fidelity --contexts 8192,16384 --steps 256 --texts 2 --shares 0.25 --fixed= "
        "--blocks 128,32 --scores max,max-p4,oracle"]
    # candidate scores side by side: $SCORES, default MAX against MAXMEAN over 16- and 4-cell pages
    res = _sh(script, "args", "passkey-4k-scores", "passkey-32k-scores", "fidelity-scores",
              OPENCOTI_DEVICE_CUDA="1")
    assert res.stdout.splitlines() == [
        "passkey-4k-scores: passkey --samples 4096:100 --shares 0.25 --fixed= --per-doc 10 "
        "--scores max,maxmean,maxmean-p4",
        "passkey-32k-scores: passkey --samples 32768:100 --shares 0.25,0.125 --fixed= --per-doc 10 "
        "--scores max,maxmean,maxmean-p4",
        "fidelity-scores: fidelity --contexts 8192,16384,32768 --steps 256 --texts 2 --shares 0.25 --fixed= "
        "--scores max,maxmean,maxmean-p4"]
    res = _sh(script, "args", "passkey-8k-scores", OPENCOTI_DEVICE_CUDA="1", SCORES="max,mass-p1")
    assert res.stdout.strip().endswith("--scores max,mass-p1")
    # the fine unit: every score of $SCORES over 128- and 32-token blocks
    res = _sh(script, "args", "passkey-4k-fine", "passkey-8k-fine", OPENCOTI_DEVICE_CUDA="1",
              SCORES="maxmean,maxmean-p4", SAMPLES="300")
    assert res.stdout.splitlines() == [
        "passkey-4k-fine: passkey --samples 4096:300 --shares 0.25 --fixed= --per-doc 10 --blocks 128,32 "
        "--scores maxmean,maxmean-p4",
        "passkey-8k-fine: passkey --samples 8192:300 --shares 0.25,0.125 --fixed= --per-doc 10 "
        "--blocks 128,32 --scores maxmean,maxmean-p4"]
    # a fixed budget beside the shares (the 2048 tokens of the quality bar at 32K)
    res = _sh(script, "args", "passkey-32k-scores", "passkey-4k-fine", OPENCOTI_DEVICE_CUDA="1",
              SCORES="maxmean-pauto", FIXED="2048")
    assert res.stdout.splitlines() == [
        "passkey-32k-scores: passkey --samples 32768:100 --shares 0.25,0.125 --fixed=2048 --per-doc 10 "
        "--scores maxmean-pauto",
        "passkey-4k-fine: passkey --samples 4096:100 --shares 0.25 --fixed=2048 --per-doc 10 --blocks 128,32 "
        "--scores maxmean-pauto"]
    # another seed: other prompts, the same budgets
    res = _sh(script, "args", "passkey-4k", OPENCOTI_DEVICE_CUDA="1", SEED="4321")
    assert res.stdout.strip() == ("passkey-4k: passkey --samples 4096:100 --shares 0.25,0.125 --fixed 2048 "
                                  "--per-doc 10 --seed 4321")
    res = _sh(script, "args", "passkey-4k", "fidelity", OPENCOTI_DEVICE_CUDA="0")  # the CPU dry run: tiny
    assert res.stdout.splitlines() == [
        "passkey-4k: passkey --samples 2048:4 --shares 0.5 --fixed 768 --per-doc 2",
        "fidelity: fidelity --contexts 2048 --steps 32 --shares 0.5 --fixed 768"]


def test_prose_bundle_is_the_same_corpus_and_deterministic(tmp_path: Path) -> None:
    long = ("This paragraph is long enough to count as prose for the corpus, because it has well over "
            "twenty-five words in it and it ends with a full stop like a real sentence does in running text.")
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.html").write_text(f"<p>{long}</p><p>{long.replace('This', 'That')} &amp; more.</p>")
    (src / "b.md").write_text(f"# T\n\n- {long} item\n\nA [link](x) and {long}\n")
    paras = prose.load_corpus([src])
    one, two = tmp_path / "one.txt.gz", tmp_path / "two.txt.gz"
    assert prose.write_bundle(paras, one) == prose.write_bundle(paras, two)
    assert one.read_bytes() == two.read_bytes()
    assert prose.load_corpus([one]) == paras
    plain = tmp_path / "c.txt"
    prose.write_bundle(paras, plain)
    assert prose.load_corpus([plain]) == paras
    with pytest.raises(Exception, match="line break"):
        prose.write_bundle(["two\nlines"], tmp_path / "x.txt")


def test_wait_returns_at_once_without_a_run_a_failed_stage_or_a_dead_runner(tmp_path: Path) -> None:
    """`wait` must not sit out its limit (device time) when nothing more can come."""
    import time

    script = _tree(tmp_path / "t")
    qw = tmp_path / "qw"
    t0 = time.monotonic()
    res = _sh(script, "wait", "60", OPENCOTI_QUALITY_WORK=str(qw))
    assert res.returncode != 0 and "no run in" in res.stdout
    (qw / "log").mkdir(parents=True)
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    (qw / "pid").write_text(dead + "\n")
    (qw / "log" / "status").write_text("10:00:00 begin env\n10:00:01 end env rc=0\n10:00:01 begin harness\n")
    res = _sh(script, "wait", "60", OPENCOTI_QUALITY_WORK=str(qw), OUT=str(tmp_path / "out"))
    assert "the runner died" in res.stdout
    (qw / "log" / "status").write_text("10:00:00 begin env\n10:00:01 end env rc=0\n10:00:01 begin harness\n"
                                       "10:00:09 end harness rc=2\n")
    with subprocess.Popen(["sleep", "60"]) as alive:
        (qw / "pid").write_text(f"{alive.pid}\n")
        res = _sh(script, "wait", "60", OPENCOTI_QUALITY_WORK=str(qw), OUT=str(tmp_path / "out"))
        alive.kill()
    assert "end harness rc=2" in res.stdout
    assert (tmp_path / "out" / "quality-status.txt").is_file()
    assert time.monotonic() - t0 < 30


def test_split_refuses_parts_that_do_not_fit_beside_the_working_tree(tmp_path: Path) -> None:
    """A call carries the working tree and one part: parts that overflow the carry limit with the tree are
    refused before anything is written (the parts already there stay), with the part size that fits."""
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(3 << 20))
    root = tmp_path / "here"
    script = _tree(root)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "docs.bin").write_bytes(os.urandom(3 << 19))  # 1.5 MiB the call copies: with the script, 2 MiB
    old = root / ".carry" / "gemma"
    old.mkdir(parents=True)
    (old / "part1").write_bytes(b"an earlier split")
    (root / ".gitignore").write_text(".carry/\n")
    res = _sh(script, "split", MODEL=str(model), PART_MIB="3", CARRY_MIB="4")
    assert res.returncode == 1
    assert "parts of 3 MiB and the working tree (2 MiB) exceed the 4 MiB a device call carries: split with " \
           "PART_MIB=1 or less" in res.stderr
    assert (old / "part1").read_bytes() == b"an earlier split"
    res = _sh(script, "split", MODEL=str(model), PART_MIB="1", CARRY_MIB="2")
    assert res.returncode == 1 and "the tree leaves no room for a part" in res.stderr
    res = _sh(script, "split", MODEL=str(model), PART_MIB="1", CARRY_MIB="4")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in old.iterdir()) == ["MANIFEST", "part1", "part2", "part3"]
