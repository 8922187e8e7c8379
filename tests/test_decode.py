"""The lab's one decode (lab/batch.py ``decode``) and the passkey and fidelity runs on it (lab/passkey.py,
lab/fidelity.py), with a stand-in ``opencoti-harness-batch`` that writes logit dumps: a config on the command
line (one process each, as the eval gates run) and ``--variants`` (one shared prefill, as the selector tools
run) give the same answers and the same comparisons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opencoti_patch.errors import OpencotiError
from opencoti_patch.lab import batch, fidelity, passkey, variants

FAKE = r'''#!{python}
import json, struct, sys
args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
reqs = [json.loads(l) for l in open(opt("--batch")) if l.strip()]
n_ctx = int(opt("-c"))
if "--variants" in args:
    cfgs = [json.loads(l) for l in open(opt("--variants")) if l.strip()]
else:
    cfgs = [{{"sparse_attn": "--sparse-attn" in args, "topk": int(opt("--sparse-attn-topk", 0)),
             "block_size": int(opt("--sparse-attn-block-size", 128))}}]
V = 8
for r in reqs:
    words = r["text"].split()
    if r.get("tokenize_only"):
        print(json.dumps({{"id": r["id"], "n_tokens": len(words)}})); continue
    steps = r.get("n_forced", 0) + max(0, r.get("n_generate", 0) - 1) + (1 if r.get("n_generate") else 0)
    for c in cfgs:
        sparse = c.get("sparse_attn", False)
        kept = c.get("topk", 0) * c.get("block_size", 128)
        shift = 0.0 if not sparse or kept >= n_ctx else 1.0 / (1 + c.get("topk", 0))
        if "dump" in r:
            path = r["dump"] + ("." + c["name"] if "name" in c else "")
            rows = [float((i * 7 + j * 3) % 11) + (shift if j == 0 else 0.0)
                    for i in range(steps) for j in range(V)]
            open(path, "wb").write(struct.pack(f"{{len(rows)}}f", *rows))
        key = r["text"].split("The pass key is ")[-1].split(".")[0] if "pass key" in r["text"] else ""
        out = {{"id": r["id"], "n_tokens": len(words), "n_vocab": V, "decode_steps": steps,
               "select_nodes": 3 * steps if sparse else 0, "select_nodes_prefill": 0,
               "targets": [j % V for j in range(steps)], "text": " " + (key if shift < 0.5 else "0") + ".",
               "ms_prefill": 1.0, "ms_decode": 1.0, "n_prefill": r.get("n_prefill", 0), "reused": 0}}
        if "name" in c:
            out["variant"] = c["name"]
        print(json.dumps(out), flush=True)
'''


@pytest.fixture
def harness(tmp_path: Path) -> batch.Harness:
    exe = tmp_path / "fake-harness-batch"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    return batch.Harness(exe=exe, model=tmp_path / "m.gguf", log_dir=tmp_path / "logs")


def configs(n_ctx: int) -> list[variants.AttnConfig]:
    budget = variants.budget_config(n_ctx, 0.25)
    return [variants.DENSE, budget, variants.window_config(budget, n_ctx), variants.select_all_config(n_ctx)]


TEXT = " ".join(f"w{i}" for i in range(1200))


@pytest.mark.parametrize("shared_prefill", [False, True])
def test_fidelity_compares_every_config_with_dense(harness: batch.Harness, shared_prefill: bool) -> None:
    rows, decoded = fidelity.run_fidelity(harness, 1024, configs(1024), [("t", TEXT)], steps=16,
                                          margin=64, shared_prefill=shared_prefill, jobs=2)
    by = {r["cfg"].name: r for r in rows}
    assert list(by) == ["sparse-25%", "window-25%", "select-all"]
    assert by["select-all"]["identical"] and by["select-all"]["kl_mean"] == 0.0
    assert 0 < by["sparse-25%"]["kl_mean"] < by["window-25%"]["kl_mean"]
    assert by["sparse-25%"]["select_nodes_per_step"] == 3.0
    assert by["sparse-25%"]["n_prefill"] == 1024 - 16 - 64
    assert len(decoded.runs) == (0 if shared_prefill else 4)


def test_both_ways_give_the_same_comparisons(harness: batch.Harness) -> None:
    def rows(shared_prefill: bool) -> dict[str, dict[str, object]]:
        found, _ = fidelity.run_fidelity(harness, 1024, configs(1024), [("t", TEXT)], steps=16, margin=64,
                                         shared_prefill=shared_prefill)
        return {r["cfg"].name: r for r in found}

    assert rows(False) == rows(True)


def test_a_text_shorter_than_the_steps_is_refused(harness: batch.Harness) -> None:
    with pytest.raises(OpencotiError, match="has 900 tokens"):
        fidelity.run_fidelity(harness, 1024, configs(1024), [("t", TEXT[:TEXT.index("w900")])], steps=16,
                              margin=64, shared_prefill=True)


@pytest.mark.parametrize("shared_prefill", [False, True])
def test_passkey_answers_per_config(harness: batch.Harness, shared_prefill: bool) -> None:
    reqs = tuple({"id": f"s{i}", "text": f"filler {i} The pass key is 1234{i}. more", "n_generate": 4}
                 for i in range(3))
    group = batch.Group(2048, tuple(configs(2048)), reqs, "passkey 2048")
    (answers,), _ = passkey.run_passkey(harness, [group], n_generate=4, shared_prefill=shared_prefill)
    assert answers["dense"] == answers["select-all"] == {f"s{i}": f"1234{i}" for i in range(3)}
    assert set(answers["window-25%"].values()) == {"0"}
    with pytest.raises(OpencotiError, match="do not fit 8"):
        passkey.run_passkey(harness, [batch.Group(8, (variants.DENSE,), reqs, "tiny")], n_generate=4,
                            shared_prefill=shared_prefill)
