"""CUDA reproducibility smoke test for `opencoti-patch rebuild --cuda` (run on the GPU machine).

    python3 ci/device/cuda-repro.py WORK LABEL [LABEL...]   # build the pristine tree once per label
    python3 ci/device/cuda-repro.py WORK --compare A B      # compare the two manifests

The tree is `.carry/llama-pristine.tar.gz` (bench.pack_slim of a pristine export), unpacked once to
WORK/llama.cpp. Each label is a fresh build without ccache in its own folder, so equal hashes mean
nvcc + the launcher (--frandom-seed, --objdir-as-tempdir, prefix maps) give path-independent bytes.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opencoti_patch.builds import builder as b  # noqa: E402
from opencoti_patch.builds import stamp as stamp_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    if sys.argv[2] == "--compare":
        ma, mb = (json.loads((work / lbl / "build" / stamp_mod.MANIFEST_JSON).read_text())
                  for lbl in sys.argv[3:5])
        ha = {stamp_mod.artifact_key(a["name"]): a["sha256"] for a in ma["artifacts"]}
        hb = {stamp_mod.artifact_key(a["name"]): a["sha256"] for a in mb["artifacts"]}
        bad = 0
        for k in sorted(set(ha) | set(hb)):
            same = ha.get(k) == hb.get(k)
            bad += not same
            print(f"{'==' if same else '!='} {k} {ha.get(k, '-')[:16]} {hb.get(k, '-')[:16]}")
        print(json.dumps({"toolchain": ma["toolchain"], "identical": bad == 0}, indent=1))
        return 1 if bad else 0
    tree = work / "llama.cpp"
    if not tree.is_dir():
        with tarfile.open(ROOT / ".carry" / "llama-pristine.tar.gz") as tar:
            tar.extractall(work)
    opts = b.BuildOptions(targets=("ggml-base", "ggml", "ggml-cpu", "ggml-cuda", "llama"),
                          optional_targets=(), cuda=True, cuda_arch="90", ccache=False)
    for label in sys.argv[2:]:
        manifest, out = stamp_mod.rebuild(tree, work, opts, label=label, rev=None, pin="0c1e57098",
                                          patches_dir=None, fresh=True, progress=True,
                                          template_dirs=[ROOT / "opencoti_patch" / "templates"])
        print(label, out, [(a["name"], a["sha256"][:16]) for a in manifest["artifacts"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
