"""Memory: the peak of each phase (forward, backward, optimizer) and the bytes of the model states.

GPU: the CUDA caching allocator's peak (`torch.cuda.max_memory_allocated`), reset when a phase begins
(`reset_peak_memory_stats`); both are host-side reads, no synchronize. This resets the process-wide
peak counter, which other code reading it will notice.

CPU: there is no tensor allocator with statistics, so the figure is the process's peak resident set
size (VmHWM in /proc/self/status), reset when a phase begins by writing 5 to /proc/self/clear_refs
(Linux >= 4.0). It covers everything in the process (Python, libraries, loader buffers), not only
tensors, and counts pages touched, not bytes allocated. Where clear_refs cannot be written the current
RSS is sampled at phase boundaries instead, and the method says so.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainprof.env import VMRSS, cpu_peak_rss_bytes, fold_peak_memory, proc_status_bytes

PHASES = ("forward", "backward", "optimizer")


class PhaseMemory:
    """Peak memory per phase for the current step; `begin`/`end` nest (only the outermost counts).

    Args:
        device: the compute device (CUDA -> allocator peak, otherwise process RSS peak).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peaks: dict[str, int] = {}
        self._depth = {p: 0 for p in PHASES}
        self._status = False  # /proc/self/status readable (env.proc_status_bytes keeps its fd)
        self._clear_fd: int | None = None
        if self.cuda:
            self.method = ("cuda_allocator_peak: torch.cuda.max_memory_allocated per phase, reset at phase "
                           "start with torch.cuda.reset_peak_memory_stats")
            return
        self._status = proc_status_bytes(VMRSS) is not None
        if not self._status:
            self.method = "unavailable: /proc/self/status cannot be read on this system"
            return
        try:
            self._clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            self.method = ("cpu_process_peak_rss: VmHWM of this rank's process per phase, reset at phase start "
                           "via /proc/self/clear_refs; all process memory, not only tensors")
        except OSError:
            self.method = ("cpu_process_rss_sampled: VmRSS of this rank's process read at phase start and end "
                           "(peak reset not permitted); all process memory, not only tensors")

    @property
    def available(self) -> bool:
        return self.cuda or self._status

    def start_step(self) -> None:
        self.peaks = {}
        self._depth = {p: 0 for p in PHASES}

    def begin(self, phase: str) -> None:
        if phase not in self._depth or not self.available:
            return
        self._depth[phase] += 1
        if self._depth[phase] != 1:
            return
        if self.cuda or self._clear_fd is not None:
            fold_peak_memory(self.device)  # keep the runner's step / lifetime peak across this reset
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._clear_fd is not None:
            os.write(self._clear_fd, b"5")
        else:
            self._note(phase, self._rss())

    def end(self, phase: str) -> None:
        if phase not in self._depth or not self.available or self._depth[phase] == 0:
            return
        self._depth[phase] -= 1
        if self._depth[phase]:
            return
        if self.cuda:
            value = int(torch.cuda.max_memory_allocated(self.device))
        elif self._clear_fd is not None:
            value = cpu_peak_rss_bytes()  # VmHWM, read as ru_maxrss where that is the same figure
        else:
            value = self._rss()
        self._note(phase, value)

    def _note(self, phase: str, value: int) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), value)

    @staticmethod
    def _rss() -> int:
        return proc_status_bytes(VMRSS) or 0

    def close(self) -> None:
        if self._clear_fd is not None:
            os.close(self._clear_fd)
        self._status, self._clear_fd = False, None


def _tensor_bytes(t: Any, seen: set[int]) -> int:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
        return 0
    if is_traceable_wrapper_subclass(t):  # e.g. torchao's quantized Adam states: codes + scales + code book
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name), seen) for name in names)
    key = t.data_ptr()
    if key in seen:
        return 0
    seen.add(key)
    return t.numel() * t.element_size()


def _local(t: Any) -> Any:
    """What this rank stores of a tensor: a ZeRO-3 parameter's shard (`ds_tensor`), an FSDP2 DTensor's
    local shard, else the tensor itself."""
    ds_tensor = getattr(t, "ds_tensor", None)
    if ds_tensor is not None:
        return ds_tensor
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer holding the states: itself, or a DeepSpeed ZeRO optimizer's `.optimizer`."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def model_state_bytes(model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Bytes this rank holds for parameters, gradients and optimizer states (ZeRO-aware).

    ZeRO-3 parameters count their local shard (`ds_tensor`), FSDP2's DTensors theirs, 4-bit parameters
    their packed storage.
    Gradients are model `.grad`s plus the fp32 partitions' grads and DeepSpeed's flat gradient buffers
    where present. Optimizer states are the tensors in the (inner) torch optimizer's `state`; fp32 master
    copies that ZeRO keeps apart from the model weights are `master_params`.

    Args:
        model: the model.
        optimizer: a torch optimizer or a DeepSpeed ZeRO optimizer, or a list of them (a Lightning module's
            several); None: no optimizer states.
    Returns:
        {params, grads, optimizer_states, master_params, total, optimizer_state_elements,
        optimizer_state_quantized_elements (those held block-quantized, e.g. by torchao), method}.
    """
    seen: set[int] = set()
    params = grads = 0
    model_ptrs: set[int] = set()
    for p in model.parameters():
        stored = _local(p)
        params += _tensor_bytes(stored, seen)
        if stored.numel():
            model_ptrs.add(stored.data_ptr())
    for p in model.parameters():
        grads += _tensor_bytes(p.grad, seen)
        grads += _tensor_bytes(getattr(p, "main_grad", None), seen)  # Megatron: views of its fp32 grad buffer
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    # DeepSpeed keeps reduced gradient partitions in its own buffers
    for opt in optimizers:
        grads += _tensor_bytes(getattr(opt, "grad_partitions_flat_buffer", None), seen)
        averaged = getattr(opt, "averaged_gradients", None)
        if isinstance(averaged, dict):
            for group in averaged.values():
                for g in group or ():
                    grads += _tensor_bytes(g, seen)
    states = master = state_elements = quantized_elements = 0
    for opt in optimizers:
        inner = _inner_optimizer(opt)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                stored = _local(p)
                if stored.numel() and stored.data_ptr() not in model_ptrs:
                    master += _tensor_bytes(stored, seen)
                grads += _tensor_bytes(p.grad, seen)
        # ZeRO-3 puts its fp32 partitions in the optimizer's groups only during step(): read them here
        for flat in getattr(opt, "fp32_partitioned_groups_flat", None) or ():
            if isinstance(flat, torch.Tensor) and flat.numel() and flat.data_ptr() not in model_ptrs:
                master += _tensor_bytes(flat, seen)
        for state in inner.state.values():
            for value in state.values():
                states += _tensor_bytes(value, seen)
                value = _local(value)  # FSDP2's states are DTensors: this rank's shard
                if isinstance(value, torch.Tensor) and value.numel() > 1:  # not the step counters
                    state_elements += value.numel()
                    quantized_elements += value.numel() if is_traceable_wrapper_subclass(value) else 0
    return {
        "params": params,
        "grads": grads,
        "optimizer_states": states,
        "master_params": master,
        "total": params + grads + states + master,
        "optimizer_state_elements": state_elements,
        "optimizer_state_quantized_elements": quantized_elements,
        "method": ("bytes of tensors this rank stores, each storage counted once: ZeRO-3 shards, packed 4-bit "
                   "weights, .grad and DeepSpeed gradient buffers, the torch optimizer's state (quantized "
                   "states as their codes, scales and code books) and fp32 master copies"),
    }


ACTIVATION_METHOD = (
    "bytes of the tensors autograd saved for backward during each micro batch's forward on the "
    "FLOP-counting step (torch.autograd.graph.saved_tensors_hooks), each storage counted once, parameters "
    "excluded; the max over micro batches (a pipeline stage: each micro batch's forward action, though its "
    "schedule holds several at once). Under non-reentrant activation checkpointing the checkpointed "
    "layers' inputs, which the checkpoint holds itself, are not included"
)


class SavedActivations:
    """Activation memory of a forward: what autograd saves for backward, counted as it is saved.

    Counts outside backward regions only: in backward, recomputation saves a layer's tensors again
    for a moment, and reentrant checkpointing nests backward calls. The first backward of a micro
    batch closes that micro batch's count.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {id(p) for p in model.parameters()}
        self._current: dict[int, int] = {}
        self.max_bytes: int | None = None
        self._backward_depth = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _identity)

    def backward_begins(self) -> None:
        if self._backward_depth == 0:
            self.forward_done()
        self._backward_depth += 1

    def backward_ends(self) -> None:
        self._backward_depth = max(self._backward_depth - 1, 0)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.forward_done()

    def forward_done(self) -> None:
        if self._current:
            self.max_bytes = max(self.max_bytes or 0, sum(self._current.values()))
        self._current.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a linear saves its weight as a transposed view
        if self._backward_depth == 0 and id(base) not in self._params and t.device.type != "meta":
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                return t
            self._current[storage.data_ptr()] = storage.nbytes()
        return t


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
