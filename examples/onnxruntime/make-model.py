#!/usr/bin/env python3
"""Writes ordinary ONNX models for packd's ONNX Runtime tests and benchmarks.

    python make-model.py OUT.onnx mlp  [--width 1024] [--layers 4] [--bump]
    python make-model.py OUT.onnx conv [--bump]
    python make-model.py OUT.onnx minilm MODEL_DIR [--external] [--bump]

mlp     MatMul+Add+Relu layers of width x width f32 weights (seeded random)
conv    a small convolutional net: Conv 3x3 (stride 2) / Relu / Conv 3x3 / Relu / Conv 1x1 /
        GlobalAveragePool / Gemm, f32, seeded random weights, input [1, 3, 64, 64]
minilm  all-MiniLM-L6-v2 (MODEL_DIR/model.safetensors) as an exported model would have it:
        every weight an initializer inside the model, or with --external in OUT.onnx.data
        beside it (ONNX's external data format)
--bump  adds 1.0 to one weight, so that the model differs in one value
"""

import argparse
import pathlib
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = pathlib.Path(__file__).resolve().parents[2]


def mlp(width, layers, bump):
    rng = np.random.default_rng(7)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        b = (rng.standard_normal(width) / 10).astype(np.float32)
        if bump and i == layers - 1:
            w[0, 0] += 1.0
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]))
        nodes.append(helper.make_node("Relu", [f"a{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="packd-test")


def conv(bump):
    rng = np.random.default_rng(11)
    inits, nodes = [], []

    def weight(name, shape):
        w = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, name))
        return w

    def bias(name, n):
        inits.append(numpy_helper.from_array((rng.standard_normal(n) / 10).astype(np.float32), name))

    weight("c1", (64, 3, 3, 3)); bias("c1b", 64)
    weight("c2", (128, 64, 3, 3)); bias("c2b", 128)
    w3 = weight("c3", (256, 128, 1, 1)); bias("c3b", 256)
    if bump:
        w3[0, 0, 0, 0] += 1.0
        inits[-2] = numpy_helper.from_array(w3, "c3")
    weight("fc", (10, 256)); bias("fcb", 10)
    nodes += [
        helper.make_node("Conv", ["x", "c1", "c1b"], ["y1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2", "c2b"], ["y2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y2"], ["r2"]),
        helper.make_node("Conv", ["r2", "c3", "c3b"], ["y3"], kernel_shape=[1, 1]),
        helper.make_node("GlobalAveragePool", ["y3"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="packd-test")


def minilm(model_dir, bump):
    sys.path.insert(0, str(ROOT / "examples" / "python"))
    import onnxruntime_minilm as mini

    weights = mini.read_safetensors(pathlib.Path(model_dir) / "model.safetensors")
    if bump:
        w = weights["encoder.layer.5.output.dense.weight"].copy()
        w[0, 0] += 1.0
        weights["encoder.layer.5.output.dense.weight"] = w
    with tempfile.TemporaryDirectory() as tmp:
        path = mini.build_graph({k: v.shape for k, v in weights.items()}, pathlib.Path(tmp))
        model = onnx.load(path, load_external_data=False)
    for i, t in enumerate(model.graph.initializer):
        if t.data_location == TensorProto.EXTERNAL:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(weights[t.name]), t.name))
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("kind", choices=["mlp", "conv", "minilm"])
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--external", action="store_true")
    p.add_argument("--bump", action="store_true")
    a = p.parse_args()
    if a.kind == "mlp":
        model = mlp(a.width, a.layers, a.bump)
    elif a.kind == "conv":
        model = conv(a.bump)
    else:
        if not a.model_dir:
            p.error("minilm needs MODEL_DIR (with model.safetensors)")
        model = minilm(a.model_dir, a.bump)
    out = pathlib.Path(a.out)
    if a.external:
        onnx.save_model(model, out, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=out.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, out)


if __name__ == "__main__":
    main()
