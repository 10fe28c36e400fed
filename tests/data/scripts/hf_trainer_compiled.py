"""An HF Trainer script with `TrainingArguments(torch_compile=True)` that adds trainprof's callback itself
(a test subject for tests/test_hf_compile.py): tiny random-init Llama, synthetic tokens, gradient
accumulation 2, CPU, inductor. The Trainer (through Accelerate) runs `torch.compile(model)`.

    python hf_trainer_compiled.py OUTPUT_DIR --steps 4
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from trainprof.integrations.hf import TrainprofCallback

parser = argparse.ArgumentParser()
parser.add_argument("output_dir")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
model = LlamaForCausalLM(config)


class Synthetic(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                                  gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[], save_strategy="no",
                                  logging_steps=1, use_cpu=True, disable_tqdm=True, torch_compile=True)
callback = TrainprofCallback(name="hf-compiled")
trainer = Trainer(model=model, args=training_args, train_dataset=Synthetic(), callbacks=[callback])
result = trainer.train()
print(f"hf_trainer_compiled done: {trainer.state.global_step} optimizer steps, loss {result.training_loss:.3f}, "
      f"runs {type(trainer.model_wrapped).__name__}")
