"""Models and toggles on CPU: LoRA/QLoRA train only adapters, recompute is exact and saves
activation memory, SDPA matches eager attention."""

from __future__ import annotations

import pytest
import torch

from trainprof.data import build_loader
from trainprof.engines import DistContext
from trainprof.engines.torch_engine import TorchEngine
from trainprof.models import build_model, count_params
from trainprof.recipe import load_recipe

from conftest import QUICKSTART

BASE = ["engine.kind=torch", "zero_stage=0", "data.seq_len=64", "train.micro_batch_size=2", "model.dtype=fp32"]


def make_engine(*overrides: str) -> tuple[TorchEngine, object]:
    recipe = load_recipe(QUICKSTART, [*BASE, *overrides])
    torch.manual_seed(recipe.train.seed)
    engine = TorchEngine(recipe, DistContext())
    loader = build_loader(recipe, vocab_size=1024, rank=0, world_size=1)
    return engine, iter(loader)


def train_steps(engine: TorchEngine, batches, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = engine.forward(next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_finetuning_trains_only_adapters(kind):
    engine, batches = make_engine(f"task.kind={kind}", "model.dtype=bf16", "optimizer.lr=0.01")
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    losses = train_steps(engine, batches, 8)
    after = dict(engine.module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed == trainable  # every adapter moved, nothing else did
    assert losses[-1] < losses[0]
    counts = count_params(engine.module)
    assert counts["trainable"] == sum(before[n].numel() for n in trainable)
    if kind == "qlora":
        import bitsandbytes as bnb

        linears4 = [m for m in engine.module.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(linears4) == 2 * 7  # every decoder linear of both layers is 4-bit
        assert linears4[0].weight.quant_state.quant_type == "nf4"
        assert counts["total"] == 664_192 + counts["trainable"]  # 4-bit params counted unpacked


def saved_activation_bytes(engine: TorchEngine, batch) -> int:
    """Bytes autograd keeps for backward during one forward, measured with saved_tensors_hooks
    (non-reentrant checkpointing stores its own placeholders instead of the activations)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.forward(batch)
    loss.backward()
    return sum(seen.values())


def test_recompute_same_losses_less_activation_memory():
    plain, batches_a = make_engine("model.recompute=false")
    recomputed, batches_b = make_engine("model.recompute=true")
    assert train_steps(plain, batches_a, 4) == pytest.approx(train_steps(recomputed, batches_b, 4), rel=1e-5, abs=1e-6)
    batch = next(make_engine()[1])
    plain_bytes = saved_activation_bytes(plain, batch)
    recomputed_bytes = saved_activation_bytes(recomputed, batch)
    assert recomputed_bytes < 0.6 * plain_bytes, (recomputed_bytes, plain_bytes)


def test_sdpa_matches_eager():
    recipe_eager = load_recipe(QUICKSTART, [*BASE, "model.attention=eager"])
    recipe_sdpa = load_recipe(QUICKSTART, [*BASE, "model.attention=sdpa"])
    torch.manual_seed(0)
    eager = build_model(recipe_eager)
    torch.manual_seed(0)
    sdpa = build_model(recipe_sdpa)
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 1024, (2, 64))
    out_e, out_s = eager(input_ids=ids, labels=ids), sdpa(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_s.logits, out_e.logits, rtol=1e-4, atol=1e-4)
    out_e.loss.backward()
    out_s.loss.backward()
    for (n, pe), (_, ps) in zip(eager.named_parameters(), sdpa.named_parameters()):
        torch.testing.assert_close(ps.grad, pe.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_meta_build_of_70b_is_instant_and_exact():
    import time

    recipe = load_recipe(QUICKSTART, ["model.name=llama2-70b", "data.seq_len=350"])
    start = time.perf_counter()
    model = build_model(recipe, meta=True)
    assert time.perf_counter() - start < 10
    assert count_params(model)["total"] == 68_976_648_192  # Llama-2-70b, grouped-query attention


@pytest.mark.parametrize("kind", ["pretrain", "qlora"])
def test_local_checkpoint_loads_without_download(tmp_path, kind):
    """A local HF checkpoint (saved here from a random model) loads offline, in 4 bits for qlora."""
    recipe = load_recipe(QUICKSTART, BASE)
    torch.manual_seed(0)
    build_model(recipe).save_pretrained(tmp_path / "ckpt")
    loaded = build_model(load_recipe(QUICKSTART, [*BASE, f"model.checkpoint={tmp_path / 'ckpt'}", f"task.kind={kind}",
                                                  "task.quant.compute_dtype=fp32"]))
    assert loaded.training
    ids = torch.randint(0, 1024, (1, 32))
    assert torch.isfinite(loaded(input_ids=ids, labels=ids).loss)
    if kind == "qlora":
        import bitsandbytes as bnb

        assert sum(isinstance(m, bnb.nn.Linear4bit) for m in loaded.modules()) == 14
        assert {n for n, p in loaded.named_parameters() if p.requires_grad} and all(
            "lora_" in n for n, p in loaded.named_parameters() if p.requires_grad)
