"""A plain loop over an FSDP2 (fully_shard) Llama with trainprof.Profiler, in a process group of one: prints,
for each way of sharding (reshard after forward, keep, CPU offload, a bf16 MixedPrecisionPolicy), the
workload's engine block, its model.dtype and the compute dtype MFU is priced at."""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from trainprof import Profiler
from trainprof.distributed import free_port
from trainprof.profiler.result import compute_dtype

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
ids = torch.randint(0, 64, (2, 16))
engines = {}
bf16 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
for mode, reshard, kwargs in (("reshard", True, {}), ("keep", False, {}),
                              ("offload", True, {"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
                              ("bf16", True, bf16)):
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Profiler(model, optimizer=opt, warmup_steps=1) as prof:
        for _ in range(2):
            with prof.step():
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
    workload = prof.workload()
    engines[mode] = {**workload["engine"], "dtype": workload["model"]["dtype"], "mfu_dtype": compute_dtype(model),
                     "unknown": workload["unknown"]}
print(json.dumps(engines))
dist.destroy_process_group()
