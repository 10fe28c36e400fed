"""A plain Lightning script that knows nothing of trainprof (a test subject for
`python -m trainprof.wrap`): tiny random-init Llama, synthetic tokens, accumulate_grad_batches 2, CPU.

    python lightning_module.py --steps 5
    torchrun --nproc_per_node 2 lightning_module.py --steps 5     # DDP on 2 CPU ranks (gloo)
"""

import argparse
import os

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)


class TinyLlama(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                                  max_position_embeddings=64))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


data = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(data, batch_size=2)
world_size = int(os.environ.get("WORLD_SIZE", 1))  # under torchrun: DDP over its ranks
trainer = L.Trainer(max_steps=args.steps, accumulate_grad_batches=2, accelerator="cpu", devices=world_size,
                    strategy="ddp" if world_size > 1 else "auto", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(TinyLlama(), loader)
print(f"lightning done: {trainer.global_step} optimizer steps")
