#!/usr/bin/env python3
"""Writes a .tflite model for packd's LiteRT tests and benchmark, without TensorFlow.

The model is built with the flatbuffer schema LiteRT's wheel ships
(`ai_edge_litert.schema_py_generated`) and the `flatbuffers` runtime:

    input [1, 8, 8, 8] -> CONV_2D 3x3 -> DEPTHWISE_CONV_2D 3x3 -> FULLY_CONNECTED (WIDTH units)
        -> LAYERS x FULLY_CONNECTED (WIDTH x WIDTH) -> FULLY_CONNECTED (16 units)

Every weight is a constant, so XNNPACK packs each of them once at load. `--dtype f32` has f32
weights and activations; `--dtype int8` is a fully quantized model (int8 activations,
per-channel int8 weights, int32 biases), which XNNPACK runs with its QS8 kernels.
Weights come from a seeded generator: the same arguments write the same bytes, and `--seed`
or `--bump` (one weight changed by one step) give a different model of the same shape.

    python make-model.py OUT.tflite [--dtype f32|int8] [--width W] [--layers L] [--seed N] [--bump]

The default model holds 0.3 MB of f32 weights; `--width 2048 --layers 24` about 400 MB.
"""

import argparse
import sys

import numpy as np

try:
    from ai_edge_litert import schema_py_generated as s
except ImportError:  # pragma: no cover - named in the error
    sys.exit("make-model.py: needs ai-edge-litert (pip install ai-edge-litert==2.3.0)")
import flatbuffers

SIDE = 8  # input height and width


def build(dtype: str, width: int, layers: int, seed: int, bump: bool) -> bytes:
    rng = np.random.default_rng(seed)
    channels = 8
    conv_out = 16
    hidden = width
    out = 16

    buffers = [s.BufferT()]  # buffer 0: the empty buffer every model starts with
    tensors = []

    def buffer(arr: np.ndarray) -> int:
        b = s.BufferT()
        b.data = np.frombuffer(arr.tobytes(), dtype=np.uint8)
        buffers.append(b)
        return len(buffers) - 1

    def quant(scale, zero_point, dim=0):
        q = s.QuantizationParametersT()
        q.scale = [float(x) for x in np.atleast_1d(scale)]
        q.zeroPoint = [int(x) for x in np.atleast_1d(zero_point)]
        q.quantizedDimension = dim
        return q

    def tensor(name, shape, ttype, data=None, q=None) -> int:
        t = s.TensorT()
        t.name = name
        t.shape = list(shape)
        t.type = ttype
        t.buffer = buffer(data) if data is not None else 0
        t.quantization = q
        tensors.append(t)
        return len(tensors) - 1

    int8 = dtype == "int8"
    act_type = s.TensorType.INT8 if int8 else s.TensorType.FLOAT32
    act_scale = 0.05

    def act(name, shape):
        return tensor(name, shape, act_type, q=quant(act_scale, 0) if int8 else None)

    first = [True]

    def weights(name, shape, fan_in, dim):
        w = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        if bump and first[0]:
            w.flat[0] += 0.5
        first[0] = False
        if not int8:
            return tensor(name, shape, s.TensorType.FLOAT32, w), None
        axis = tuple(i for i in range(len(shape)) if i != dim)
        scale = np.maximum(np.abs(w).max(axis=axis), 1e-6) / 127.0
        expand = [1] * len(shape)
        expand[dim] = -1
        wq = np.clip(np.round(w / scale.reshape(expand)), -127, 127).astype(np.int8)
        return tensor(name, shape, s.TensorType.INT8, wq, quant(scale, np.zeros_like(scale, dtype=np.int64), dim)), scale

    def bias(name, n, wscale):
        b = (rng.standard_normal(n) * 0.1).astype(np.float32)
        if not int8:
            return tensor(name, [n], s.TensorType.FLOAT32, b)
        bscale = act_scale * wscale
        bq = np.round(b / bscale).astype(np.int32)
        return tensor(name, [n], s.TensorType.INT32, bq, quant(bscale, np.zeros(n, dtype=np.int64)))

    ops = []
    codes = []

    def op(code, inputs, outputs, opt_type, opt):
        if code not in codes:
            codes.append(code)
        o = s.OperatorT()
        o.opcodeIndex = codes.index(code)
        o.inputs = inputs
        o.outputs = outputs
        o.builtinOptionsType = opt_type
        o.builtinOptions = opt
        ops.append(o)

    x = act("input", [1, SIDE, SIDE, channels])

    w, ws = weights("conv/weights", [conv_out, 3, 3, channels], 9 * channels, 0)
    b = bias("conv/bias", conv_out, ws)
    y = act("conv/out", [1, SIDE, SIDE, conv_out])
    c = s.Conv2DOptionsT()
    c.padding, c.strideW, c.strideH = s.Padding.SAME, 1, 1
    c.fusedActivationFunction = s.ActivationFunctionType.RELU
    op(s.BuiltinOperator.CONV_2D, [x, w, b], [y], s.BuiltinOptions.Conv2DOptions, c)

    w, ws = weights("dwconv/weights", [1, 3, 3, conv_out], 9, 3)
    b = bias("dwconv/bias", conv_out, ws)
    z = act("dwconv/out", [1, SIDE, SIDE, conv_out])
    d = s.DepthwiseConv2DOptionsT()
    d.padding, d.strideW, d.strideH, d.depthMultiplier = s.Padding.SAME, 1, 1, 1
    op(s.BuiltinOperator.DEPTHWISE_CONV_2D, [y, w, b], [z], s.BuiltinOptions.DepthwiseConv2DOptions, d)

    flat = SIDE * SIDE * conv_out
    w, ws = weights("fc1/weights", [hidden, flat], flat, 0)
    b = bias("fc1/bias", hidden, ws)
    h = act("fc1/out", [1, hidden])
    f = s.FullyConnectedOptionsT()
    f.fusedActivationFunction = s.ActivationFunctionType.RELU
    op(s.BuiltinOperator.FULLY_CONNECTED, [z, w, b], [h], s.BuiltinOptions.FullyConnectedOptions, f)

    for i in range(layers):
        w, ws = weights(f"hidden{i}/weights", [hidden, hidden], hidden, 0)
        b = bias(f"hidden{i}/bias", hidden, ws)
        nxt = act(f"hidden{i}/out", [1, hidden])
        f = s.FullyConnectedOptionsT()
        f.fusedActivationFunction = s.ActivationFunctionType.RELU
        op(s.BuiltinOperator.FULLY_CONNECTED, [h, w, b], [nxt], s.BuiltinOptions.FullyConnectedOptions, f)
        h = nxt

    w, ws = weights("fc2/weights", [out, hidden], hidden, 0)
    b = bias("fc2/bias", out, ws)
    o = act("output", [1, out])
    op(s.BuiltinOperator.FULLY_CONNECTED, [h, w, b], [o], s.BuiltinOptions.FullyConnectedOptions,
       s.FullyConnectedOptionsT())

    g = s.SubGraphT()
    g.tensors, g.inputs, g.outputs, g.operators, g.name = tensors, [x], [o], ops, "main"

    def tmap(name, index):
        m = s.TensorMapT()
        m.name, m.tensorIndex = name, index
        return m

    sig = s.SignatureDefT()
    sig.signatureKey = "serving_default"
    sig.subgraphIndex = 0
    sig.inputs = [tmap("input", x)]
    sig.outputs = [tmap("output", o)]

    m = s.ModelT()
    m.version = 3
    m.description = f"packd test model ({dtype}, width {width}, layers {layers}, seed {seed}{', bumped' if bump else ''})"
    m.operatorCodes = []
    for code in codes:
        oc = s.OperatorCodeT()
        oc.builtinCode = code
        oc.deprecatedBuiltinCode = min(code, 127)
        oc.version = 1
        m.operatorCodes.append(oc)
    m.subgraphs = [g]
    m.buffers = buffers
    m.signatureDefs = [sig]

    builder = flatbuffers.Builder(1024)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .tflite file to write")
    p.add_argument("--dtype", choices=["f32", "int8"], default="f32")
    p.add_argument("--width", type=int, default=256,
                   help="the first fully connected layer's units (weights grow with it; default 256)")
    p.add_argument("--layers", type=int, default=1, help="hidden WIDTH x WIDTH layers (default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bump", action="store_true", help="change one weight by one step")
    a = p.parse_args()
    data = build(a.dtype, a.width, a.layers, a.seed, a.bump)
    with open(a.out, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    main()
