"""A plain DeepSpeed ZeRO-2 training script that knows nothing of trainprof (a test subject for
`python -m trainprof.wrap`): tiny random-init Llama, synthetic tokens, gradient accumulation 2, an
evaluation forward after each optimizer step.

    torchrun --nproc_per_node 2 ds_zero2.py --steps 5
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
model = LlamaForCausalLM(config)
ds_config = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "train_batch_size": 2 * 2 * dist.get_world_size(),
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(args.steps * 2):
    ids = torch.randint(0, 256, (2, 128), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if step % 2 == 1:  # an evaluation forward after each optimizer step: no training step's work
        with torch.no_grad():
            engine(input_ids=ids[:1])
if dist.get_rank() == 0:
    print(f"ds_zero2 done: {engine.global_steps} optimizer steps, loss {loss.item():.3f}")
dist.destroy_process_group()
