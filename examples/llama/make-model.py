#!/usr/bin/env python3
"""Writes a LLaMA-architecture GGUF with random (seeded, reproducible) quantised weights and a
minimal SentencePiece-style vocabulary, for tests and benchmarks of packd's llama.cpp
integration — no model download needed. It loads and generates (garbage text).

  make-model.py OUT.gguf [--layers 4] [--dim 256] [--ffn 768] [--heads 4] [--vocab 512]
                         [--quant mixed|q4_0|q8_0|q4_k] [--seed 1]

--quant mixed (the default) mixes four types: Q4_0 for attn_q/k/v and the output, IQ4_NL for
attn_output, Q8_0 for ffn_gate/ffn_up, Q4_K for ffn_down. On x86 with AVX2 llama.cpp's CPU
backend repacks Q4_0, IQ4_NL and Q4_K (to three different interleaved layouts) and leaves Q8_0
in the file (it repacks Q8_0 on Arm only). The other quants use one type for every matrix. The token embedding is
F16 and the norms F32 (never repacked). Needs the PyPI packages gguf and numpy.
"""
import argparse
import sys

try:
    import numpy as np
    import gguf
except ImportError as e:  # pragma: no cover - a message, not a traceback
    sys.exit(f"make-model.py: {e.name} is missing: pip install gguf numpy")

Q = gguf.GGMLQuantizationType
# Block layouts: (elements per block, bytes per block, byte offsets of f16 scales).
BLOCKS = {Q.Q4_0: (32, 18, (0,)), Q.Q8_0: (32, 34, (0,)), Q.Q4_K: (256, 144, (0, 2)), Q.IQ4_NL: (32, 18, (0,))}


def quant_matrix(rng, rows, cols, qtype):
    """A (rows, cols) matrix as random blocks of `qtype` with small finite scales."""
    per, size, scales = BLOCKS[qtype]
    if cols % per:
        sys.exit(f"make-model.py: {cols} columns are not a multiple of {per} ({qtype.name})")
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:
        d = rng.uniform(0.002, 0.02, size=(rows, cols // per)).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, cols // per * size)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--quant", choices=["mixed", "q4_0", "q8_0", "q4_k"], default="mixed")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.vocab < 300:
        sys.exit("make-model.py: --vocab must be at least 300 (259 special and byte tokens)")
    rng = np.random.default_rng(a.seed)
    one = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K}.get(a.quant)
    kind = lambda role: one or {"attn": Q.Q4_0, "attn_output": Q.IQ4_NL, "up": Q.Q8_0, "down": Q.Q4_K, "out": Q.Q4_0}[role]

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("packd-synthetic")
    w.add_context_length(2048)
    w.add_embedding_length(a.dim)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(a.dim // a.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581w{i}" for i in range(a.vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (a.vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(a.vocab)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def q(name, rows, cols, role):
        t = kind(role)
        w.add_tensor(name, quant_matrix(rng, rows, cols, t), raw_dtype=t)

    w.add_tensor("token_embd.weight", rng.normal(0, 0.02, size=(a.vocab, a.dim)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(a.dim, dtype=np.float32))
    q("output.weight", a.vocab, a.dim, "out")
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(a.dim, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(a.dim, dtype=np.float32))
        for n in ("attn_q", "attn_k", "attn_v"):
            q(b + n + ".weight", a.dim, a.dim, "attn")
        q(b + "attn_output.weight", a.dim, a.dim, "attn_output")
        q(b + "ffn_gate.weight", a.ffn, a.dim, "up")
        q(b + "ffn_up.weight", a.ffn, a.dim, "up")
        q(b + "ffn_down.weight", a.dim, a.ffn, "down")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
