"""The profiler against ground truth: a synthetic model whose modules wait known (and recorded)
durations in forward and backward, nested, with a module called twice and a checkpointed block.

Tolerances from issue 3: every module's forward / backward / recompute within 5%, the step closes
within 2% (unattributed_ms / wall_ms). Each step is compared with what its own waits really took, and
the median over steps of the relative error must be within 5%: a loaded CI machine can preempt the
process in one step, which is noise in the machine, not in the attribution.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import pytest
import torch

from helpers.checks import check_closure, module_rows_per_step, retry_on_noise
from helpers.checks import check_modules as _check_modules
from helpers.synthetic import Synthetic, phase_truth_ms, train, truth_ms

REL = 0.05  # phase times within 5%
pytestmark = pytest.mark.timed  # module times against the waits really made
ABS_MS = 0.15


@pytest.fixture(autouse=True)
def _quiet_process():
    """One intra-op thread and, where permitted, a higher scheduling priority: timing tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        os.nice(-5)
        raised = True
    except OSError:
        raised = False
    yield
    torch.set_num_threads(threads)
    if raised:
        os.nice(5)


def _modules(result: dict) -> dict[str, dict]:
    return {m["name"]: m for m in result["modules"]}


def assert_close(measured: float, truth: float, what: str, rel: float = REL) -> None:
    if truth == 0:
        assert abs(measured) < ABS_MS, f"{what}: measured {measured:.3f} ms where nothing ran"
    else:
        assert abs(measured - truth) <= rel * truth, f"{what}: measured {measured:.3f} ms, truth {truth:.3f} ms"


def check_modules(prof, ledger: list, names: list[str]) -> None:
    rows, index = module_rows_per_step(prof)
    _check_modules(rows, index, ledger, names)


LEAVES = ["embed", "block.own", "block.inner1", "block.inner2", "shared", "ckpt.body", "head"]
PARENTS = ["", "block", "ckpt"]


def test_module_phase_times_recovered_with_recompute_and_called_twice():
    def run() -> None:
        model = Synthetic()
        prof, ledger = train(model, {"module_depth": 2}, steps=5)
        result = prof.result()
        check_modules(prof, ledger, LEAVES + PARENTS)
        mods = _modules(result)
        assert mods["shared"]["calls"] == 2 and mods["embed"]["calls"] == 1
        # self time of a parent is its own work only: block's own child is measured, so block's self ~ 0.
        # What remains is the autograd and hook machinery between its three children (0.2-0.35 ms of
        # backward, varying from process to process); a child's time leaking in would be >= 12 ms.
        for phase in ("forward", "backward"):
            own = abs(mods["block"][f"self_{phase}_ms"])
            assert own < max(0.3, 0.01 * mods["block"][f"{phase}_ms"]), (phase, own, mods["block"][f"{phase}_ms"])
        # the checkpointed body re-ran once inside backward: recompute, not forward
        assert mods["ckpt.body"]["recompute_calls"] == 1 and mods["ckpt.body"]["calls"] == 1
        s = result["summary"]["phases_ms"]
        for phase in ("data_wait", "optimizer", "recompute", "forward", "backward"):
            assert_close(s[phase], phase_truth_ms(ledger, phase), f"phase {phase}")
        check_closure(result)
        assert result["env"]["timer"] == "host"

    retry_on_noise(run)


def test_reentrant_checkpoint_is_recompute():
    def run() -> None:
        model = Synthetic(reentrant=True)
        prof, ledger = train(model, {"module_depth": 2, "flops": False}, warmup=0, steps=3)
        result = prof.result()
        check_modules(prof, ledger, ["ckpt.body", "head", ""])
        mods = _modules(result)
        # reentrant checkpointing re-runs the body in its own backward and backpropagates through it in a
        # nested graph task: recompute and backward still land on the body, and the wrapper's backward
        # holds the body's plus the checkpoint machinery's own (sub-ms) work
        assert_close(mods["ckpt"]["recompute_ms"], truth_ms(ledger, "ckpt", "recompute"), "ckpt recompute")
        assert 0 <= mods["ckpt"]["self_backward_ms"] < 1.5
        check_closure(result)

    retry_on_noise(run)


def test_gradient_accumulation_is_one_step():
    def run() -> None:
        model = Synthetic()
        prof, ledger = train(model, {"module_depth": 2, "flops": False}, warmup=0, steps=3, grad_accum=2)
        result = prof.result()
        assert len(result["steps"]) == 3
        mods = _modules(result)
        assert mods["shared"]["calls"] == 4 and mods["embed"]["calls"] == 2 and mods[""]["calls"] == 2
        check_modules(prof, ledger, LEAVES + PARENTS)
        assert_close(result["summary"]["phases_ms"]["optimizer"], phase_truth_ms(ledger, "optimizer"), "optimizer")
        assert result["steps"][0]["tokens"] == 4  # two micro batches of 2, recorded by the loop
        check_closure(result)

    retry_on_noise(run)


def test_lora_on_frozen_base_times_backward_per_module():
    def run() -> None:
        from peft import LoraConfig, inject_adapter_in_model

        model = Synthetic()
        model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=["proj"], lora_dropout=0.0), model)
        for name, p in model.named_parameters():
            p.requires_grad = "lora_" in name
        # the first module's input is data (no grad) and its base weights are frozen: only the adapter trains
        prof, ledger = train(model, {"module_depth": 3, "flops": False}, warmup=0, steps=3)
        result = prof.result()
        check_modules(prof, ledger, LEAVES + PARENTS)
        mods = _modules(result)
        assert mods["embed.proj"]["params_trainable"] < mods["embed.proj"]["params"]
        check_closure(result)

    retry_on_noise(run)


def _hook_state(model: torch.nn.Module) -> dict:
    state = {}
    for name, mod in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            state[(name, attr)] = list(getattr(mod, attr, {}).keys())
    for name, p in model.named_parameters():
        state[(name, "_post_accumulate_grad_hooks")] = list((p._post_accumulate_grad_hooks or {}).keys())
        state[(name, "_backward_hooks")] = list((p._backward_hooks or {}).keys())
    return state


def test_close_removes_every_hook():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from trainprof.profiler import Profiler

    model = Synthetic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.register_forward_hook(lambda *a: None)  # a user's own hook must survive
    before = _hook_state(model)
    opt_before = (list(opt._optimizer_step_pre_hooks), list(opt._optimizer_step_post_hooks), dict(opt.__dict__))
    dist_before = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}
    c10d_before = c10d.all_gather_into_tensor
    backward_before = torch.autograd.backward
    with Profiler(model, optimizer=opt, module_depth=5) as prof:
        assert _hook_state(model) != before
        assert dist.all_reduce is not dist_before["all_reduce"]
        assert "step" in opt.__dict__ and torch.autograd.backward is not backward_before
        with prof.step():
            model(torch.randn(2, 8)).backward()
            opt.step()
    assert _hook_state(model) == before
    assert (list(opt._optimizer_step_pre_hooks), list(opt._optimizer_step_post_hooks), dict(opt.__dict__)) == opt_before
    assert {name: getattr(dist, name) for name in dist_before} == dist_before
    assert c10d.all_gather_into_tensor is c10d_before
    assert torch.autograd.backward is backward_before


def test_compute_dtype_follows_autocast():
    """fp32 master weights under AMP run their matmuls in bf16: MFU must use the bf16 peak, not fp32's
    (seen on an H100: the torch engine's bf16 run reported MFU 151% against the fp32 peak)."""
    from trainprof.profiler import Profiler
    from trainprof.profiler.result import recorded_dtype

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    for autocast, expected in ((False, "fp32"), (True, "bf16")):
        with Profiler(model, module_depth=1, flops=False) as prof:
            with prof.step(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(torch.randn(4, 8)).float().sum().backward()
        assert recorded_dtype(prof) == expected


def test_an_evaluation_forward_inside_a_step_counts_no_tokens():
    """A step's training forward sees 2 x 5 token ids; an evaluation forward of 3 x 5 inside the same step,
    under no_grad or inference_mode, trains on none: the step's tokens are 10, whatever the eval saw."""
    from trainprof.profiler import Profiler

    class Tokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.embed(input_ids).sum()

    model = Tokens()
    for evaluation in (torch.no_grad, torch.inference_mode):
        with Profiler(model, module_depth=1, flops=False) as prof:
            with prof.step():
                model(torch.randint(0, 16, (2, 5))).backward()
                with evaluation():
                    model(torch.randint(0, 16, (3, 5)))
        assert prof.result()["steps"][0]["tokens"] == 10, evaluation


def test_backward_is_timed_for_modules_called_outside_the_model_and_for_autograd_grad():
    """Node hooks are registered in one loop when the outermost profiled call returns (hooks.flush):
    a submodule the loop calls directly, outside the model's forward, and a backward run by
    torch.autograd.grad (which opens no backward region) still get their backward windows."""
    from helpers.synthetic import Busy, name_busy_modules

    from trainprof.profiler import Profiler

    model = torch.nn.Sequential(Busy(1.0, 6.0), Busy(1.0, 3.0))
    name_busy_modules(model)
    with Profiler(model, module_depth=1, flops=False, memory=False) as prof:
        for _ in range(3):
            with prof.step():
                x = torch.randn(2, 8, requires_grad=True)
                y = model[1](model[0](x))  # no call of the model itself: each child is outermost
                torch.autograd.grad(y.sum(), [x, *model.parameters()])
    rows = {m["name"]: m for m in prof.result()["modules"]}
    # a wait lasts at least its duration, so a window that was never opened (0 ms) cannot pass
    assert rows["0"]["backward_ms"] >= 6.0 * 0.95 and rows["1"]["backward_ms"] >= 3.0 * 0.95, rows


def test_steps_are_analysed_when_read_and_a_long_backlog_at_once(monkeypatch):
    """The hooks only stamp: a step's module x phase analysis runs when `Profiler.steps` is read, or at
    once when ANALYSE_BACKLOG_STEPS steps wait (which bounds what the timelines hold); both give the
    breakdown that closes."""
    import trainprof.profiler.core as core

    monkeypatch.setattr(core, "ANALYSE_BACKLOG_STEPS", 3)
    prof, _ = train(Synthetic(), {"module_depth": 2, "flops": False}, warmup=0, steps=4)
    waiting = [record.breakdown is None for record in prof._steps]
    assert waiting == [False, False, False, True]  # the first three analysed as the third finished
    assert prof.waiting_steps == 1 and prof.last_step == (prof._steps[-1], prof._unanalysed[0][1])
    # no tensor waits with it: a kept loss tensor pinned its allocation among the freed activations and
    # the CPU heap grew by megabytes a step
    assert prof.last_timeline.losses and all(type(x) is float for x in prof.last_timeline.losses)
    assert all(s.breakdown is not None and s.loss is not None for s in prof.steps) and prof.waiting_steps == 0
    check_closure(prof.result())


class _Marker:
    """Lives as long as the autograd node whose ctx holds it (its graph's saved state)."""


class _Marked(torch.autograd.Function):
    """y = 2x whose node holds a _Marker: alive exactly as long as the graph node is."""

    alive: list = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.marker = _Marker()
        _Marked.alive.append(weakref.ref(ctx.marker))
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _MarkedBody(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_Marked.apply(self.lin(x)))


class _TwoCheckpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.reentrant = _MarkedBody(), _MarkedBody(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=self.reentrant)
        return torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=self.reentrant).pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_no_graph_outlives_its_backward(reentrant: bool):
    """The profiler watches autograd nodes; once a micro batch's backward is over none of its graph may stay
    alive, recomputed ones included (under non-reentrant checkpointing the re-run's graph is never run
    backward: holding its nodes to the step's end held every recomputed activation, on an H100 22 GiB of
    ZeRO-3's 47.5 GiB peak, docs/memory.md)."""
    from trainprof.profiler import Profiler

    def alive_after_each_backward(model: torch.nn.Module, profiled: bool) -> list[int]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        alive = []
        with contextlib.ExitStack() as stack:
            prof = stack.enter_context(Profiler(model, optimizer=opt, warmup_steps=0, module_depth=3, flops=False)) \
                if profiled else None
            for _ in range(2):
                with prof.step() if prof else contextlib.nullcontext():
                    for _ in range(2):  # gradient accumulation: each micro batch's graph must go at its backward
                        _Marked.alive.clear()
                        model(torch.randn(4, 8, requires_grad=reentrant)).backward()
                        alive.append(sum(ref() is not None for ref in _Marked.alive))
                    opt.step()
                    opt.zero_grad()
        assert len(_Marked.alive) in (2, 4), _Marked.alive  # forward, and recompute where it builds a graph
        return alive

    torch.manual_seed(0)
    assert alive_after_each_backward(_TwoCheckpointed(reentrant), profiled=False) == [0, 0, 0, 0]
    assert alive_after_each_backward(_TwoCheckpointed(reentrant), profiled=True) == [0, 0, 0, 0]
