"""optimizer.state_bits: full-parameter training with torchao's 8/4-bit Adam states, on the torch engine
and under real DeepSpeed ZeRO, measured (not assumed) in profile.json and in the sweep table."""

from __future__ import annotations

import json
import os
import subprocess

import pandas as pd
import pytest
import torch

from conftest import QUIET, REPO, TRAINPROF_CELLS, run_trainprof
from trainprof.engines.optim import param_groups
from trainprof.models import build_model
from trainprof.plan import estimate_plan
from trainprof.profiler.memory import model_state_bytes
from trainprof.recipe import load_recipe, recipe_from_dict

# torchao: per moment 1/2 B of 4-bit codes + one fp32 scale per 128 elements, against 4 B in fp32
FOUR_BIT_RATIO = (0.5 + 4 / 128) / 4


def test_param_groups_put_matrices_apart_from_norms():
    recipe = load_recipe(REPO / "recipes" / "quickstart_cpu.yaml", ["optimizer.weight_decay=0.1"])
    model = build_model(recipe, device=torch.device("cpu"))
    matrices, vectors = param_groups(model, 0.1)
    assert matrices["weight_decay"] == 0.1 and vectors["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in matrices["params"]) and all(p.ndim == 1 for p in vectors["params"])
    assert len(matrices["params"]) + len(vectors["params"]) == len(list(model.parameters()))
    # the matrices' flat ZeRO partition on 2 ranks stays a multiple of torchao's 4-bit block; with the
    # 1-D norms mixed in it would not (and torchao would silently keep fp32 states)
    n_matrices = sum(p.numel() for p in matrices["params"])
    n_all = sum(p.numel() for p in model.parameters())
    assert (n_matrices // 2) % 128 == 0 and (n_all // 2) % 128 != 0


@pytest.mark.timeout(600)
def test_four_bit_states_train_every_parameter_in_an_eighth_of_the_bytes(tmp_path):
    fp32_dir, fp32 = run_trainprof(tmp_path / "fp32", 1, "engine.kind=torch", "engine.zero_stage=0", *QUIET)
    q_dir, q = run_trainprof(tmp_path / "q4", 1, "engine.kind=torch", "engine.zero_stage=0",
                             "optimizer.state_bits=4", *QUIET, timeout=480)
    a, b = fp32["model_state_bytes"], q["model_state_bytes"]
    assert a["optimizer_state_quantized_elements"] == 0
    # every matrix's moments are quantized; only the 1-D norm weights (< 4096 elements) stay fp32
    assert b["optimizer_state_quantized_elements"] / b["optimizer_state_elements"] > 0.99
    assert b["optimizer_states"] / a["optimizer_states"] == pytest.approx(FOUR_BIT_RATIO, rel=0.05)
    assert b["params"] == a["params"] and b["grads"] == a["grads"]
    losses = [s["loss"] for s in q["steps"] if not s.get("warmup")]
    assert losses[-1] < losses[0] - 0.5, losses  # it still trains
    # the FLOP-counting step ran with the compiled optimizer, and its FLOPs match the fp32 run's
    assert q["summary"]["flops_per_step"] == fp32["summary"]["flops_per_step"]
    summary = (q_dir / "summary.md").read_text()
    assert "of optimizer-state elements block-quantized" in summary

    # `trainprof plan`'s accounting against what the runs measured: params and grads exact, optimizer
    # states within the fp32 norm weights and step counters plan does not model
    for measured in (fp32, q):
        recipe = recipe_from_dict(measured["recipe"])
        planned = estimate_plan(recipe, 1)["model_states"]["per_rank"]
        got = measured["model_state_bytes"]
        assert planned["params"]["gpu_bytes"] + planned["params"]["cpu_bytes"] == got["params"]
        assert planned["grads"]["gpu_bytes"] == got["grads"]
        assert planned["optimizer"]["gpu_bytes"] == pytest.approx(got["optimizer_states"], rel=0.01)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_bit_row_of_a_zero3_sweep(tmp_path):
    sweep = tmp_path / "four_bit.yaml"
    sweep.write_text(f"""
recipe: {REPO / 'recipes' / 'quickstart_cpu.yaml'}
nproc: 2
timeout_s: 480
overrides: [data.seq_len=64, train.micro_batch_size=2, train.steps=4, train.warmup_steps=1, engine.zero_stage=3,
            {", ".join(QUIET)}]
cells:
  - {{name: ZeRO-3}}
  - {{name: ZeRO-3 + 4-bit, overrides: [optimizer.state_bits=4]}}
""")
    out = tmp_path / "out"
    proc = subprocess.run([*TRAINPROF_CELLS, "sweep", str(sweep), "--out", str(out)],
                          capture_output=True, text=True, timeout=880, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    df = pd.read_csv(out / "results.csv").set_index("cell")
    assert set(df["status"]) == {"done"}, df[["status", "failure_message"]]
    base, q = df.loc["ZeRO-3"], df.loc["ZeRO-3 + 4-bit"]
    assert base["optimizer_states_quantized_frac"] == 0 and q["optimizer_states_quantized_frac"] > 0.99
    # ZeRO-3 hands torchao one flat fp32 partition per group: the matrices' is quantized
    assert q["optimizer_states_mib"] / base["optimizer_states_mib"] == pytest.approx(FOUR_BIT_RATIO, rel=0.05)
    assert q["model_states_mib"] < base["model_states_mib"]
    assert "optimizer states MiB" in (out / "results.md").read_text()
    for cell in ("ZeRO-3", "ZeRO-3 + 4-bit"):
        profile = json.loads((REPO / df.loc[cell, "run_dir"] / "profile.json").read_text())
        losses = [s["loss"] for s in profile["steps"] if not s.get("warmup")]
        assert losses[-1] < losses[0], (cell, losses)


def test_model_state_bytes_counts_quantized_states_by_their_storage():
    from torchao.optim import AdamW4bit

    lin = torch.nn.Linear(256, 128, bias=False)
    opt = AdamW4bit(lin.parameters(), lr=1e-3)
    # states are created lazily by step(); build them the way step() does, without compiling it
    opt.state[lin.weight]["exp_avg"] = opt._new_buffer(lin.weight, True)
    opt.state[lin.weight]["exp_avg_sq"] = opt._new_buffer(lin.weight, False)
    state = model_state_bytes(lin, opt)
    n = lin.weight.numel()
    # codes n/2 B + fp32 scales n/128 * 4 B + the 16-entry fp32 code book, for each moment
    assert state["optimizer_states"] == 2 * (n // 2 + n // 128 * 4 + 16 * 4)
    assert state["optimizer_state_quantized_elements"] == state["optimizer_state_elements"] == 2 * n
