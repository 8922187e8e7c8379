"""ci/device/kernel_profile.py: steps, groups, exclusive time under overlapping (PDL) kernels, host gaps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "ci/device/kernel_profile.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _trace(path: Path, steps: int, step_gap_ns: int, upload_ns: int = 0) -> None:
    """Steps of fa + combine + memset, step_gap_ns apart; upload_ns > 0: an input copy that long before."""
    lines = ["kind\tstart\tend\tgraph\tstream\tgrid\tblock\tname"]
    t = 1_000 + upload_ns
    for _ in range(steps):
        if upload_ns:
            lines.append(f"M\t{t - upload_ns}\t{t - upload_ns + 2_000}\t0\t7\t0,0,0\t0,0,0\tmemcpy:HtoD")
        # fa runs 10 us; combine starts 2 us into it (PDL) and ends 3 us after it: 3 us exclusive, 11 us long
        lines.append(f"K\t{t}\t{t + 10_000}\t1\t7\t1,1,1\t32,1,1\tflash_attn_ext_vec")
        lines.append(f"K\t{t + 2_000}\t{t + 13_000}\t1\t7\t1,1,1\t32,1,1\tflash_attn_combine_results")
        lines.append(f"S\t{t + 14_000}\t{t + 15_000}\t1\t7\t0,0,0\t0,0,0\tmemset:64")
        t += 15_000 + step_gap_ns
    path.write_text("\n".join(lines) + "\n")


def test_exclusive_time_and_gap(tmp_path: Path) -> None:
    kp = _load()
    trace = tmp_path / "t.tsv"
    _trace(trace, steps=6, step_gap_ns=200_000)
    steps = kp.split_steps(kp.read_trace(str(trace)), gap_ns=30_000)
    assert len(steps) == 6
    (group,) = kp.group_steps(steps, min_steps=4)
    s = kp.summarize(group)
    by_name = {k["name"]: k for k in s["kernels"]}
    assert by_name["flash_attn_combine_results"]["us_per_step"] == 11.0
    assert by_name["flash_attn_combine_results"]["exclusive_us_per_step"] == 3.0
    assert by_name["flash_attn_ext_vec"]["exclusive_us_per_step"] == 10.0
    assert s["span_us_per_step"] == 15.0
    assert s["busy_us_per_step"] == 22.0
    assert s["gap_us_median"] == 200.0
    assert s["label"] == "dense decode"


def test_copies_between_steps_count_as_gap(tmp_path: Path) -> None:
    """A decode uploads its inputs (a copy) well before its first kernel: the copy is a step of its own in the
    timeline, yet the decode steps still form one group and the gap is measured from one step to the next."""
    kp = _load()
    trace = tmp_path / "t.tsv"
    _trace(trace, steps=6, step_gap_ns=200_000, upload_ns=80_000)
    steps = kp.split_steps(kp.read_trace(str(trace)), gap_ns=30_000)
    assert len(steps) == 12  # each decode: the copy, then the kernels
    (group,) = kp.group_steps(steps, min_steps=4)
    s = kp.summarize(group)
    assert s["steps"] == 6
    assert s["gap_us_median"] == 200.0
    assert s["span_us_per_step"] == 15.0


def test_stray_kernel_between_steps_counts_as_gap(tmp_path: Path) -> None:
    """Prompt ubatches whose output norm runs alone after a host-side split (one kernel, well after the
    ubatch): the ubatches still form one group with their gaps; the stray kernel is no group of its own."""
    kp = _load()
    trace = tmp_path / "t.tsv"
    _trace(trace, steps=6, step_gap_ns=200_000)
    lines = trace.read_text().splitlines()
    starts = [int(ln.split("\t")[1]) for ln in lines[1:] if "flash_attn_ext_vec" in ln]
    for t in starts[1:]:  # 100 us before each next step: 85 us after the previous one ends
        lines.append(f"K\t{t - 100_000}\t{t - 99_000}\t1\t7\t1,1,1\t32,1,1\trms_norm_f32")
    trace.write_text("\n".join(lines) + "\n")
    steps = kp.split_steps(kp.read_trace(str(trace)), gap_ns=30_000)
    assert len(steps) == 11
    (group,) = kp.group_steps(steps, min_steps=4)
    s = kp.summarize(group)
    assert s["steps"] == 6
    assert s["gap_us_median"] == 200.0
    assert s["span_us_per_step"] == 15.0
    assert s["step_span_us"] == [15.0] * 6
    assert s["step_gap_us"] == [None] + [200.0] * 5


def test_steps_split_only_at_idle_gaps(tmp_path: Path) -> None:
    kp = _load()
    trace = tmp_path / "t.tsv"
    _trace(trace, steps=3, step_gap_ns=20_000)  # below the 30 us gap: one step
    steps = kp.split_steps(kp.read_trace(str(trace)), gap_ns=30_000)
    assert len(steps) == 1
    assert kp.group_steps(steps, min_steps=2) == []


def test_host_gap_split_into_cuda_calls_and_own_work(tmp_path: Path) -> None:
    """With runtime API records (kind R) a gap splits into time inside CUDA calls, per call and clipped to
    the gap, and the time outside any call (overlapping calls counted once)."""
    kp = _load()
    trace = tmp_path / "t.tsv"
    _trace(trace, steps=5, step_gap_ns=200_000)
    lines = trace.read_text().splitlines()
    t_end = 1_000 + 15_000  # end of the first step
    for i in range(4):
        w0 = t_end + i * 215_000
        # the sync of the previous step ends 5 us into the gap; 100 us of own work; a 20 us memcpy call;
        # a 30 us graph launch that overlaps a 10 us call inside it; the rest of the gap is own work again
        lines.append(f"R\t{w0 - 8_000}\t{w0 + 5_000}\t0\t0\t0,0,0\t0,0,0\tcudaStreamSynchronize")
        lines.append(f"R\t{w0 + 105_000}\t{w0 + 125_000}\t0\t0\t0,0,0\t0,0,0\tcudaMemcpyAsync")
        lines.append(f"R\t{w0 + 150_000}\t{w0 + 180_000}\t0\t0\t0,0,0\t0,0,0\tcudaGraphLaunch")
        lines.append(f"R\t{w0 + 160_000}\t{w0 + 170_000}\t0\t0\t0,0,0\t0,0,0\tcudaEventRecord")
    trace.write_text("\n".join(lines) + "\n")
    acts = kp.read_trace(str(trace))
    api = [a for a in acts if a.kind == "R"]
    gpu = [a for a in acts if a.kind != "R"]
    (group,) = kp.group_steps(kp.split_steps(gpu, gap_ns=30_000), min_steps=4)
    host = kp.summarize(group, api)["host"]
    assert host["outside_cuda_us_median"] == 200.0 - 5.0 - 20.0 - 30.0
    assert host["cuda_calls_us_median"] == {
        "cudaGraphLaunch": 30.0,
        "cudaMemcpyAsync": 20.0,
        "cudaEventRecord": 10.0,
        "cudaStreamSynchronize": 5.0,
    }
    assert "outside CUDA calls" in kp.render([kp.summarize(group, api)], top=5)
    assert kp.summarize(group)["host"] is None  # no API records: no split
