"""A plain HuggingFace Trainer script that knows nothing of trainprof (a test subject for
`python -m trainprof.wrap`): tiny random-init Llama, synthetic tokens, gradient accumulation 2, CPU.

    python hf_trainer.py OUTPUT_DIR --steps 5
    torchrun --nproc_per_node 2 hf_trainer.py OUTPUT_DIR --steps 5 --zero 2   # the Trainer's DeepSpeed integration
    python hf_trainer.py OUTPUT_DIR --steps 4 --own-callback --compile     # TrainingArguments(torch_compile=True)
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("output_dir")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--zero", type=int, default=None, help="use the Trainer's DeepSpeed integration at this ZeRO stage")
parser.add_argument("--own-callback", action="store_true", help="add trainprof's callback itself (run name 'own')")
parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True): the Trainer "
                    "(through Accelerate) runs torch.compile(model)")
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
                                  logging_steps=1, use_cpu=True, disable_tqdm=True, torch_compile=args.compile,
                                  deepspeed=None if args.zero is None else {
                                      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                      "train_batch_size": "auto", "zero_optimization": {"stage": args.zero}})
callbacks = []
if args.own_callback:
    from trainprof.integrations.hf import TrainprofCallback

    callbacks.append(TrainprofCallback(name="own"))
trainer = Trainer(model=model, args=training_args, train_dataset=Synthetic(), callbacks=callbacks)
result = trainer.train()
print(f"hf_trainer done: {trainer.state.global_step} optimizer steps, loss {result.training_loss:.3f}, "
      f"runs {type(trainer.model_wrapped).__name__}")
