"""A loop of one's own whose FSDP2 fully_shard groups carry a bf16 MixedPrecisionPolicy computes in bf16 over
fp32 weights: the workload records bf16, and MFU is priced at the bf16 peak (both took the weights' fp32, and
project modelled fp32 compute).
The engine's root resharding is checked on its shared run in tests/test_fsdp.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

# A process group of one: two models, fully_shard per decoder layer and on the root, with a bf16
# MixedPrecisionPolicy and without one; prints each one's workload block.
OWN_LOOP = """
import json, os
import torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from trainprof import Profiler
from trainprof.profiler.result import compute_dtype
from trainprof.distributed import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
ids = torch.randint(0, 64, (2, 16))
workloads = {}
for mode, mp in (("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
                 ("none", MixedPrecisionPolicy())):
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, warmup_steps=1) as prof:
        for _ in range(2):
            with prof.step():
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
    workloads[mode] = {**prof.workload(), "mfu_dtype": compute_dtype(model)}
print(json.dumps(workloads))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def own_loop(tmp_path_factory):
    script = tmp_path_factory.mktemp("fsdp_own_loop") / "own_loop.py"
    script.write_text(OWN_LOOP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_bf16_mixed_precision_policy_is_the_compute_dtype(own_loop):
    for mode, dtype in (("bf16", "bf16"), ("none", "fp32")):
        w = own_loop[mode]
        assert w["model"]["dtype"] == dtype and w["unknown"] == {}, (mode, w["model"], w["unknown"])
        assert w["mfu_dtype"] == dtype, w["mfu_dtype"]  # the dense peak MFU is priced at
        assert w["engine"]["kind"] == "fsdp", w["engine"]
