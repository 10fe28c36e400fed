"""A training loop of its own (no DeepSpeed, Trainer, Lightning or Accelerate): `trainprof.wrap` finds its
model and optimizer at the first step and profiles the next two."""
import torch

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("plain loop done")
