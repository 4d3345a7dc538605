#!/usr/bin/env python3
"""Writes a LLaMA-architecture GGUF with random (seeded, reproducible) quantised weights and a
minimal SentencePiece-style vocabulary, for tests and benchmarks of packd's llama.cpp
integration — no model download needed. It loads and generates (garbage text).

  make-model.py OUT.gguf [--layers 4] [--dim 256] [--ffn 768] [--heads 4] [--vocab 512]
                         [--quant mixed|q4_0|q8_0|q4_k] [--seed 1]

--quant mixed (the default) holds every type llama.cpp's CPU backend repacks (CPU_REPACK) in
the supported versions, on x86 and on Arm: Q4_0 for attn_q/k/v and the output, IQ4_NL for
attn_output, Q4_K for ffn_down, and for ffn_gate/ffn_up by layer: Q8_0 and Q8_0, Q2_K and
Q5_K, Q6_K and MXFP4, MXFP4 and Q8_0 (layers past the fourth repeat the first's). On x86
llama.cpp repacks Q4_0, IQ4_NL, Q4_K and MXFP4 with AVX2, and Q2_K with AVX-512 too; on Arm
Q4_0, IQ4_NL, Q4_K, MXFP4, Q8_0, Q5_K and Q6_K (with dot-product instructions). The other quants
use one type for every matrix. The token embedding is F16 and the norms F32 (never repacked).
Needs the PyPI packages gguf and numpy.
"""
import argparse
import sys

try:
    import numpy as np
    import gguf
except ImportError as e:  # pragma: no cover - a message, not a traceback
    sys.exit(f"make-model.py: {e.name} is missing: pip install gguf numpy")

Q = gguf.GGMLQuantizationType
# Block layouts: (elements per block, bytes per block, byte offsets of f16 scales, byte
# offsets of E8M0 scales).
BLOCKS = {
    Q.Q4_0: (32, 18, (0,), ()),
    Q.Q8_0: (32, 34, (0,), ()),
    Q.Q4_K: (256, 144, (0, 2), ()),
    Q.IQ4_NL: (32, 18, (0,), ()),
    Q.Q2_K: (256, 84, (80, 82), ()),
    Q.Q5_K: (256, 176, (0, 2), ()),
    Q.Q6_K: (256, 210, (208,), ()),
    Q.MXFP4: (32, 17, (), (0,)),
}
# ffn_gate and ffn_up by layer (--quant mixed).
FFN = [(Q.Q8_0, Q.Q8_0), (Q.Q2_K, Q.Q5_K), (Q.Q6_K, Q.MXFP4), (Q.MXFP4, Q.Q8_0)]


def quant_matrix(rng, rows, cols, qtype):
    """A (rows, cols) matrix as random blocks of `qtype` with small finite scales."""
    per, size, scales, e8m0 = BLOCKS[qtype]
    if cols % per:
        sys.exit(f"make-model.py: {cols} columns are not a multiple of {per} ({qtype.name})")
    blocks = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:
        d = rng.uniform(0.002, 0.02, size=(rows, cols // per)).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    for off in e8m0:
        # 2^(e - 127): scales from 2^-9 to 2^-6.
        blocks[:, :, off] = rng.integers(118, 122, size=(rows, cols // per), dtype=np.uint8)
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
    def kind(role, layer=0):
        if one:
            return one
        if role in ("gate", "up"):
            return FFN[layer % len(FFN)][role == "up"]
        return {"attn": Q.Q4_0, "attn_output": Q.IQ4_NL, "down": Q.Q4_K, "out": Q.Q4_0}[role]

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

    def q(name, rows, cols, role, layer=0):
        t = kind(role, layer)
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
        q(b + "ffn_gate.weight", a.ffn, a.dim, "gate", i)
        q(b + "ffn_up.weight", a.ffn, a.dim, "up", i)
        q(b + "ffn_down.weight", a.dim, a.ffn, "down", i)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
