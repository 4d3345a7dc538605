"""The ONNX Runtime sentence-embedding worker (examples/python/onnxruntime_minilm.py) on the
real all-MiniLM-L6-v2, its weights served by a real packd: bit-exact against the same graph
with the weights loaded privately, no copy of a weight, agreement with a NumPy forward pass
that reads packd's f32-gemm layout, and embeddings that mean something.

Needs onnxruntime, onnx and tokenizers (pip) and PACKD_TEST_MODEL_DIR (a directory with
model.safetensors and tokenizer.json; .ci/run fetches it); skipped with the reason when not.
"""

import os
import pathlib
import sys

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime onnx tokenizers)")
pytest.importorskip("onnx", reason="onnx is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed")

import packd  # noqa: E402

MODEL_DIR = os.environ.get("PACKD_TEST_MODEL_DIR")
pytestmark = pytest.mark.skipif(not MODEL_DIR, reason="PACKD_TEST_MODEL_DIR (MiniLM model + tokenizer) is not set")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import onnxruntime_minilm as mini  # noqa: E402

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse."]


@pytest.fixture(scope="module")
def model_dir():
    return pathlib.Path(MODEL_DIR)


def numpy_forward(ids, mask, plain, gemm):
    """The encoder in NumPy (f64), every linear layer read from packd's f32-gemm entries
    (bias folded in) through the layout's reference consumer."""

    def linear(x, name):
        e = {en.name: en for en in gemm.entries}[name + ".weight"]
        params = dict(kv.split("=") for kv in e.layout.split(":", 1)[1].split(","))
        nr, kr, sr = int(params["nr"]), int(params["kr"]), int(params["sr"])
        assert (kr, sr) == (1, 1), "this consumer reads kr=1, sr=1 panels"
        n, k = e.shape
        blocks = gemm.tensor(name + ".weight").astype(np.float64).reshape(-(-n // nr), -1)
        y = np.empty(x.shape[:-1] + (n,))
        for b, block in enumerate(blocks):
            bias, w = block[:nr], block[nr:].reshape(-1, nr)[:k]
            cols = slice(b * nr, min((b + 1) * nr, n))
            y[..., cols] = (x @ w + bias)[..., : cols.stop - cols.start]
        return y

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + mini.EPS) * plain[name + ".weight"] + plain[name + ".bias"]

    from math import erf, sqrt
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))))
    s = ids.shape[1]
    x = plain["embeddings.word_embeddings.weight"][ids].astype(np.float64)
    x = x + plain["embeddings.position_embeddings.weight"][:s] + plain["embeddings.token_type_embeddings.weight"][0]
    x = ln(x, "embeddings.LayerNorm")
    bias = (1.0 - mask[:, None, None, :]) * -10000.0
    for i in range(mini.LAYERS):
        p = f"encoder.layer.{i}."
        q, k, v = (linear(x, p + "attention.self." + t).reshape(*ids.shape, mini.HEADS, mini.HEAD).transpose(0, 2, 1, 3)
                   for t in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(mini.HEAD) + bias
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(*ids.shape, mini.HIDDEN)
        x = ln(linear(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        x = ln(linear(gelu(linear(x, p + "intermediate.dense")), p + "output.dense") + x, p + "output.LayerNorm")
    m = mask[:, :, None].astype(np.float64)
    mean = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return mean / np.linalg.norm(mean, axis=1, keepdims=True)


def test_packd_backed_session_equals_private_weights_bit_for_bit_and_copies_nothing(daemon, model_dir):
    path = model_dir / "model.safetensors"
    model = packd.Client(daemon.dir).pack(path, layout="identity")
    shared = model.arrays()
    tok = model_dir / "tokenizer.json"
    for prepacking in (True, False):
        with_packd = mini.Embedder(shared, tok, prepacking=prepacking)
        private = mini.Embedder(mini.read_safetensors(path), tok, prepacking=prepacking)
        a, b = with_packd.embed(SENTENCES), private.embed(SENTENCES)
        assert a.dtype == np.float32 and a.shape == (len(SENTENCES), mini.HIDDEN)
        assert np.array_equal(a, b), f"prepacking={prepacking}: max diff {np.abs(a - b).max()}"
        # ORT holds the very buffers packd mapped: every weight's address lies in the mapping.
        start, end = model.address, model.address + model.size
        for name, addr in with_packd.weight_addresses().items():
            e = {en.name: en for en in model.entries}[name]
            assert addr == start + e.offset and addr + e.length <= end, name


def test_embeddings_agree_with_numpy_over_packds_gemm_layout_and_mean_something(daemon, model_dir):
    path = model_dir / "model.safetensors"
    client = packd.Client(daemon.dir)
    plain = client.pack(path, layout="identity").arrays()
    gemm = client.pack(path, layout="f32-gemm:nr=16,kr=1,sr=1")
    e = mini.Embedder(plain, model_dir / "tokenizer.json")
    got = e.embed(SENTENCES)
    ids, mask = e.encode(SENTENCES)
    want = numpy_forward(ids, mask, plain, gemm)
    # f32 in ORT against f64 in NumPy over the packed layout: within 1e-5 on the unit-length
    # embeddings (docs/INTEGRATION.md; measured 1.1e-7).
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
    sim = got @ got.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 3], sim
    # The score sentence-transformers documents for this pair with this model.
    assert abs(sim[0, 1] - 0.7553) < 1e-3, sim[0, 1]


def test_the_example_runs_as_documented(daemon, model_dir):
    """docs/INTEGRATION.md's command line, after its install step (pip install
    './python[onnxruntime]', which CI runs): the documented pair scores 0.7553."""
    import subprocess
    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "onnxruntime_minilm.py"
    out = subprocess.run([sys.executable, str(script), str(model_dir), "A man is eating food.",
                          "A man is eating a piece of bread.", "--socket-dir", str(daemon.dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cosine similarities:" in out.stdout and "0.7553" in out.stdout, out.stdout
