"""Random-weight llama GGUF files of any shape, for speed and equivalence tests.

Speed does not depend on weight values and bitwise-equivalence tests only need determinism, so the
weights are seeded noise. Quantized weights (Q4_0) are written as raw blocks directly, which takes
seconds for an 8B-shaped model instead of minutes of f16 writing + llama-quantize.

gguf-py comes from the pinned tree (`<tree>/gguf-py`) or the PyPI `gguf` package.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int = 32000
    n_ctx_train: int = 262144
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Shapes used by the benchmarks (see docs/results/decode.md).
SHAPES: dict[str, LlamaShape] = {
    # Llama-3-8B-like: 32 layers, GQA 4, head dim 128
    "8b": LlamaShape(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336),
    # Qwen2.5-14B-Instruct-1M-like attention: 48 layers, 40 heads / 8 KV heads (GQA 5)
    "14b": LlamaShape(n_layer=48, n_embd=5120, n_head=40, n_head_kv=8, n_ff=13824),
    # 1B-shaped (head dim 128, GQA 4): the serving load test, where prefill time bounds the request count
    "1b": LlamaShape(n_layer=16, n_embd=2048, n_head=16, n_head_kv=4, n_ff=8192),
    # small model for CPU tests: head dim 128, GQA 4
    "tiny": LlamaShape(n_layer=4, n_embd=1024, n_head=8, n_head_kv=2, n_ff=2048, n_vocab=4096,
                       n_ctx_train=32768),
}

_WEIGHT_TYPES = ("f32", "f16", "q4_0")
_QK4_0 = 32


def import_gguf(tree: Path | None = None) -> Any:
    """Import gguf-py, preferring the copy inside a llama.cpp tree (matches the pin exactly)."""
    if tree is not None:
        path = str(Path(tree) / "gguf-py")
        if path not in sys.path:
            sys.path.insert(0, path)
    import gguf  # noqa: PLC0415 (import depends on sys.path set above)

    return gguf


def _vocab(n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    """A minimal SPM-style vocabulary: unk/bos/eos, 256 byte tokens, then filler pieces."""
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{i:02X}>".encode() for i in range(256)]
    types += [6] * 256  # BYTE
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"\u2581t{i}".encode())
        types.append(1)  # NORMAL
        i += 1
    scores = [0.0] * 3 + [0.0] * 256 + [-float(k) for k in range(len(tokens) - 259)]
    return tokens, scores, types


def _q4_0_rows(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Raw Q4_0 blocks: per 32 values an f16 scale then 16 bytes of nibbles."""
    if cols % _QK4_0:
        raise ValueError(f"Q4_0 needs a row length divisible by {_QK4_0}, got {cols}")
    nblk = cols // _QK4_0
    out = np.empty((rows, nblk, 18), dtype=np.uint8)
    out[:, :, 0:2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    out[:, :, 2:] = rng.integers(0, 256, size=(rows, nblk, 16), dtype=np.uint8)
    return out.reshape(rows, nblk * 18)


class _Weights:
    """Makes one random matrix per distinct shape and reuses it (values do not matter)."""

    def __init__(self, weight_type: str, seed: int, share: bool) -> None:
        self.weight_type = weight_type
        self.rng = np.random.default_rng(seed)
        self.share = share
        self.cache: dict[tuple[int, int], np.ndarray] = {}

    def matrix(self, rows: int, cols: int) -> np.ndarray:
        key = (rows, cols)
        if self.share and key in self.cache:
            return self.cache[key]
        std = 1.0 / np.sqrt(cols)
        if self.weight_type == "q4_0":
            # nibbles are uniform on [-8, 7]: their std is ~4.6
            arr = _q4_0_rows(self.rng, rows, cols, std / 4.6)
        else:
            dtype = np.float16 if self.weight_type == "f16" else np.float32
            arr = (self.rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(dtype)
        if self.share:
            self.cache[key] = arr
        return arr


def write_llama_gguf(
    path: Path,
    shape: LlamaShape,
    weight_type: str = "f16",
    seed: int = 42,
    tree: Path | None = None,
    share_layers: bool | None = None,
) -> Path:
    """Write a random-weight llama model. share_layers reuses one matrix per shape (fast, big models)."""
    if weight_type not in _WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {_WEIGHT_TYPES}, got {weight_type!r}")
    gguf = import_gguf(tree)
    if share_layers is None:
        share_layers = shape.n_layer * shape.n_embd * shape.n_ff > 10**9
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }[weight_type]
    ftype = {"f32": 0, "f16": 1, "q4_0": 2}[weight_type]

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"opencoti-random-{shape.n_layer}L-{shape.n_embd}")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.n_vocab)
    w.add_file_type(ftype)
    tokens, scores, types = _vocab(shape.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    weights = _Weights(weight_type, seed, share_layers)
    ones = np.ones(shape.n_embd, dtype=np.float32)
    n_embd_kv = shape.head_dim * shape.n_head_kv

    def add(name: str, rows: int, cols: int) -> None:
        arr = weights.matrix(rows, cols)
        if weight_type == "q4_0":
            w.add_tensor(name, arr, raw_dtype=qtype)  # byte shape -> (rows, cols)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", shape.n_vocab, shape.n_embd)
    w.add_tensor("output_norm.weight", ones)
    add("output.weight", shape.n_vocab, shape.n_embd)
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", ones)
        add(p + "attn_q.weight", shape.n_embd, shape.n_embd)
        add(p + "attn_k.weight", n_embd_kv, shape.n_embd)
        add(p + "attn_v.weight", n_embd_kv, shape.n_embd)
        add(p + "attn_output.weight", shape.n_embd, shape.n_embd)
        w.add_tensor(p + "ffn_norm.weight", ones)
        add(p + "ffn_gate.weight", shape.n_ff, shape.n_embd)
        add(p + "ffn_up.weight", shape.n_ff, shape.n_embd)
        add(p + "ffn_down.weight", shape.n_embd, shape.n_ff)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse  # noqa: PLC0415 (only for the standalone use on the device machine)

    ap = argparse.ArgumentParser(description="write a random-weight llama GGUF")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--type", choices=_WEIGHT_TYPES, default="f16")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--tree", type=Path, default=None, help="llama.cpp tree whose gguf-py to use")
    a = ap.parse_args(argv)
    write_llama_gguf(a.out, SHAPES[a.shape], a.type, a.seed, a.tree)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
