"""A plain loop over an FSDP2 (fully_shard) Llama with trainprof.Profiler, in a process group of one: prints
the workload's engine block for each way of sharding (reshard after forward, keep, CPU offload)."""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from trainprof import Profiler
from trainprof.distributed import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
ids = torch.randint(0, 64, (2, 16))
engines = {}
for mode, reshard, policy in (("reshard", True, None), ("keep", False, None),
                              ("offload", True, CPUOffloadPolicy(pin_memory=False))):
    model = LlamaForCausalLM(cfg)
    kwargs = {"offload_policy": policy} if policy is not None else {}
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
    engines[mode] = prof.workload()["engine"]
print(json.dumps(engines))
dist.destroy_process_group()
