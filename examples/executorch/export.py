#!/usr/bin/env python3
"""Exports the test models to ExecuTorch programs (.pte) delegated to XNNPACK.

    python export.py OUT_DIR [--model NAME ...] [--seed N]

Models (``--list``):
  mlp        36 linear layers of MiniLM's shapes (384, 1536), f32 (~42 MB of weights)
  convnet    3x3 convolution, depthwise 3x3, 1x1 convolution, linear; f32
  qlinear    4 linear layers quantised by ExecuTorch's XNNPACK quantizer (int8 per-channel
             weights, dynamically quantised activations)
  twomethods two methods ("forward", "encode") that share their linear layers' weights
  big        linear layers of 4096 x 4096, f32 (about 1.1 GiB of weights)

``--seed`` changes every weight (another model); ``--tweak`` changes one weight of one
layer by a tiny amount (a model that must never hit the other's packing). Needs torch and
executorch (pip install torch executorch).
"""

from __future__ import annotations

import argparse
import os
import sys

MODELS = ["mlp", "convnet", "qlinear", "twomethods", "big"]


def build(name: str, seed: int, tweak: bool):
    import torch

    torch.manual_seed(seed)
    if name == "mlp":
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(384, 384) for _ in range(4)]
            layers += [torch.nn.Linear(384, 1536), torch.nn.Linear(1536, 384)]
        model = torch.nn.Sequential(*layers)
        example = (torch.randn(8, 384),)
    elif name == "convnet":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 32, 3, padding=1, groups=32),
            torch.nn.Conv2d(32, 24, 1),
            torch.nn.Flatten(),
            torch.nn.Linear(24 * 16 * 16, 10),
        )
        example = (torch.randn(1, 3, 16, 16),)
    elif name == "qlinear":
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        example = (torch.randn(4, 256),)
    elif name == "twomethods":
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
        example = (torch.randn(2, 128),)
    elif name == "big":
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(17)])
        example = (torch.randn(1, 4096),)
    else:
        raise SystemExit(f"export.py: unknown model {name!r} (--list)")
    if tweak:
        with torch.no_grad():
            first = next(p for p in model.parameters() if p.dim() >= 2)
            first.view(-1)[0] += 1e-3
    return model.eval(), example


def export(name: str, out: str, seed: int, tweak: bool) -> str:
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model, example = build(name, seed, tweak)
    if name == "qlinear":
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        quantizer = XNNPACKQuantizer().set_global(
            get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
        )
        graph = torch.export.export(model, example).module()
        graph = prepare_pt2e(graph, quantizer)
        graph(*example)
        model = convert_pt2e(graph)
    if name == "twomethods":

        class Encode(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x) * 2.0

        programs = {
            "forward": torch.export.export(model, example),
            "encode": torch.export.export(Encode(model).eval(), example),
        }
    else:
        programs = torch.export.export(model, example)
    lowered = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()])
    path = os.path.join(out, f"{name}{'-tweak' if tweak else ''}{'-s%d' % seed if seed else ''}.pte")
    with open(path, "wb") as f:
        lowered.to_executorch().write_to_file(f)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="directory to write NAME.pte into")
    p.add_argument("--model", action="append", choices=MODELS, help="a model to export (default: all but big)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (another model)")
    p.add_argument("--tweak", action="store_true", help="change one weight by 1e-3")
    p.add_argument("--list", action="store_true", help="list the models")
    a = p.parse_args()
    if a.list:
        print("\n".join(MODELS))
        return
    if not a.out:
        p.error("OUT_DIR is required")
    os.makedirs(a.out, exist_ok=True)
    for name in a.model or [m for m in MODELS if m != "big"]:
        print(export(name, a.out, a.seed, a.tweak))


if __name__ == "__main__":
    sys.exit(main())
