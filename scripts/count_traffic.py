"""Count the bytes HF Llama's non-GEMM operators move, per token, on this CPU: every aten op of one
forward and one backward that is not a GEMM, attention or a view, its input and output tensors' bytes
(a TorchDispatchMode over the real model code, sdpa attention). Fitted over shapes, the counts give
trainprof/projection/gemm.py's ELEMENTWISE_BYTES (per decoder layer: per token x h, per token x kv, per token x I, per
weight element) and REST_BYTES (the model outside its layers: per token x h, per token x V, per V x h),
for pure bf16 weights (DeepSpeed, FSDP) and for PyTorch AMP (fp32 weights under bf16 autocast).

    python scripts/count_traffic.py          # prints the fitted coefficients and the fit's largest error
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainprof.projection.probes import ProbeShape, bare_model  # noqa: E402
from trainprof.recipe import load_recipe  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_cpu.yaml"
GEMM = re.compile(r"^(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$|attention|flash")
# views and allocations move no bytes through memory
NO_TRAFFIC = re.compile(r"^(view|_unsafe_view|t|transpose|expand|permute|slice|select|unsqueeze|squeeze|reshape|"
                        r"alias|detach|as_strided|split|split_with_sizes|unbind|_reshape_alias|empty|empty_like|"
                        r"new_empty|new_empty_strided|empty_strided|lift_fresh)$")


class CountBytes(TorchDispatchMode):
    """Bytes read and written by the non-GEMM aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if not (GEMM.search(name) or NO_TRAFFIC.match(name)):
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def count(overrides: list[str], *, amp: bool, micro_batch: int, seq_len: int, layers: int) -> tuple[int, int]:
    """(forward bytes, backward bytes) of the bare model with `layers` decoder layers."""
    recipe = load_recipe(RECIPE, overrides)
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, micro_batch_size=micro_batch),
                                 data=dataclasses.replace(recipe.data, seq_len=seq_len))
    model, batch = bare_model(recipe, ProbeShape.of(recipe), layers)
    model = model.float() if amp else model.to(torch.bfloat16)
    fwd, bwd = CountBytes(), CountBytes()
    with fwd, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(**batch).loss
    with bwd:
        loss.backward()
    return fwd.bytes, bwd.bytes


def layer_rows(amp: bool) -> list[tuple[list[float], tuple[int, int]]]:
    """(features [T*h, T*kv, T*I, weights], (forward, backward) bytes of one decoder layer) over a grid,
    kv = num_kv_heads x head_dim (GQA's narrower keys and values)."""
    rows = []
    for h, i, kv_heads in ((256, 704, 4), (512, 704, 4), (256, 1408, 4), (384, 1024, 4), (256, 704, 1),
                           (512, 1408, 2), (384, 1024, 1)):
        dims = [f"model.hidden_size={h}", f"model.intermediate_size={i}", "model.num_heads=4",
                f"model.num_kv_heads={kv_heads}"]
        kv = kv_heads * h // 4
        for micro_batch in (2, 4):
            one, two = (count(dims, amp=amp, micro_batch=micro_batch, seq_len=128, layers=n) for n in (1, 2))
            rows.append(([micro_batch * 128 * h, micro_batch * 128 * kv, micro_batch * 128 * i,
                          2 * h * h + 2 * h * kv + 3 * h * i], (two[0] - one[0], two[1] - one[1])))
    return rows


def rest_rows(amp: bool) -> list[tuple[list[float], tuple[int, int]]]:
    """(features [T*h, T*V, V*h], (forward, backward) bytes of the model without layers) over a grid."""
    rows = []
    for h, v in ((256, 1024), (512, 1024), (256, 4096), (384, 2048)):
        dims = [f"model.hidden_size={h}", "model.num_heads=4", "model.num_kv_heads=4", f"model.vocab_size={v}"]
        for micro_batch in (2, 4):
            rows.append(([micro_batch * 128 * h, micro_batch * 128 * v, v * h],
                         count(dims, amp=amp, micro_batch=micro_batch, seq_len=128, layers=0)))
    return rows


def fit(rows: list[tuple[list[float], tuple[int, int]]]) -> dict[str, tuple[list[float], float]]:
    """Per phase: least-squares coefficients and the largest relative error of the fit."""
    x = np.array([f for f, _ in rows], float)
    out = {}
    for k, phase in enumerate(("forward", "backward")):
        y = np.array([b[k] for _, b in rows], float)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        out[phase] = ([round(float(c), 2) for c in coef], float(np.max(np.abs(x @ coef - y) / y)))
    return out


def main() -> int:
    torch.manual_seed(0)
    for amp in (False, True):
        regime = "amp" if amp else "bf16"
        for part, rows in (("layer [T*h, T*kv, T*I, weights]", layer_rows(amp)), ("rest [T*h, T*V, V*h]", rest_rows(amp))):
            for phase, (coef, err) in fit(rows).items():
                print(f"{regime:<5} {part:<28} {phase:<9} {coef}  (largest fit error {100 * err:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
