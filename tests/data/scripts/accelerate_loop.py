"""A plain HF Accelerate training loop that knows nothing of trainprof (a test subject for
`python -m trainprof.wrap`): tiny random-init Llama, synthetic tokens, `accelerator.accumulate` over 2
micro batches, a prepared DataLoader and LR scheduler.

    python accelerate_loop.py --steps 5                                        # one process
    torchrun --nproc_per_node 2 accelerate_loop.py --steps 5                   # DDP on CPU (gloo)
    torchrun --nproc_per_node 2 accelerate_loop.py --steps 5 --deepspeed 2     # Accelerate's DeepSpeed plugin, ZeRO-2
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--deepspeed", type=int, default=None, help="use Accelerate's DeepSpeed plugin at this ZeRO stage")
args = parser.parse_args()

torch.set_num_threads(1)
ACCUM, MICRO, SEQ = 2, 2, 32
if args.deepspeed is None:
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)  # cpu: DDP over gloo under torchrun
else:
    world = int(os.environ.get("WORLD_SIZE", 1))
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
        "train_batch_size": MICRO * ACCUM * world, "zero_optimization": {"stage": args.deepspeed}}))
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=64))


class Synthetic(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


loader = torch.utils.data.DataLoader(Synthetic(), batch_size=MICRO)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
steps = 0
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        steps += 1
        if steps == args.steps:
            break
accelerator.print(f"accelerate done: {steps} optimizer steps, {type(model).__name__}, loss {loss.item():.3f}")
accelerator.end_training()
