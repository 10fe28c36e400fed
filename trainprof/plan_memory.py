"""`trainprof plan`'s GPU memory per rank: what DeepSpeed, PyTorch and CUDA hold beside the model states
and activations, and the peaks the plan's totals sum.

Each row is one allocation rule read from the code that makes it: DeepSpeed 0.19's ZeRO optimizers
(deepspeed/runtime/zero/stage3.py, stage_1_and_2.py) and parameter coordinator
(partitioned_param_coordinator.py), PyTorch's AdamW, autocast, DDP and caching allocators; with the
recipe's `deepspeed:` values where set and DeepSpeed's defaults (zero/config.py) otherwise. A row says
when it is live: at the turn from forward to backward (every activation saved) and/or in the optimizer
step. The larger of the two phase sums is the allocated peak, what torch.cuda.max_memory_allocated
measures; the device total adds what the allocator does not count as allocated (its block rounding)
and what lives outside it (the CUDA context).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainprof.recipe import Recipe, RecipeError, resolve_shape
from trainprof.shapes import DTYPE_BYTES


@dataclass(slots=True, kw_only=True)
class SavedTensors:
    """What HF Llama keeps for backward, as (count, bytes each) per tensor shape: one decoder layer, the
    final norm and LM-head input, the logits and loss in the forward and as backward starts, and one
    layer's input (all that full recomputation keeps per layer). trainprof.plan.hf_saved_tensors builds
    it; the plan's activation figures are its sums, and the allocator rounding row rounds each tensor."""

    layer: list[tuple[int, int]]
    head: list[tuple[int, int]]
    logits: list[tuple[int, int]]
    loss_backward: list[tuple[int, int]]
    layer_input: int


def tensor_bytes(tensors: list[tuple[int, int]]) -> int:
    return sum(count * nbytes for count, nbytes in tensors)


@contextlib.contextmanager
def quiet_deepspeed() -> Iterator[None]:
    """Around a DeepSpeed import: on a machine without a GPU it logs "Setting accelerator to CPU" to
    stdout, which would corrupt `trainprof plan --json`; what the plan reads from it is plain arithmetic."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


FWD_BWD, OPT_STEP = "forward_backward", "optimizer_step"
BOTH = (FWD_BWD, OPT_STEP)
MIB = 2**20
# PyTorch's CUDA caching allocator (c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp round_size /
# get_allocation_size): every block is a multiple of 512 B; a request of 10 MiB or more gets its own
# segment rounded up to 2 MiB (smaller ones share 2 MiB and 20 MiB segments).
MIN_BLOCK_BYTES, MIN_LARGE_ALLOC_BYTES, ROUND_LARGE_BYTES = 512, 10 * MIB, 2 * MIB
# A CUDA context with lazy module loading (CUDA >= 11.7, the Linux default since 12.2): 426 MiB measured
# with PyTorch 2.10+cu130 (unsloth-zoo PR #1053); "around 400MB" (ptrblck, pytorch/pytorch#109888).
CUDA_CONTEXT_BYTES = 426 * MIB
CUDA_CONTEXT_SOURCE = (
    "the CUDA context outside PyTorch's allocator, a cited figure (the GPU reference profiles record only "
    "torch.cuda.max_memory_allocated): 426 MiB with PyTorch 2.10+cu130 and lazy module loading (unsloth-zoo "
    "PR #1053; 'around 400MB', pytorch/pytorch#109888); kernels loaded as the run first calls them (cuBLAS, "
    "NCCL, attention) add to it, up to ~1.3 GB when all load eagerly (transformers docs, model_memory_anatomy)")
# What the resident-set estimate leaves out of a CPU run's peak RSS: neither is a tensor the plan can count
RESIDENT_LEAVES_OUT = (
    "leaves out Python, PyTorch and the other libraries (about 0.45-0.5 GiB per process, measured: docs/memory.md) "
    "and the freed blocks glibc's heap keeps and cannot reuse, which grow with the batch (the CPU quickstart: about "
    "4 MiB per sample beyond the live tensors' 6.1 MiB, docs/memory.md) and depend on the order of allocations: "
    "not modelled (`trainprof project` probes them)")
# Rows that exist only on a GPU: PyTorch's CUDA caching allocator and the CUDA context
GPU_ONLY_ROWS = ("allocator_rounding", "cuda_context")


@dataclass(slots=True, kw_only=True)
class MemoryRow:
    """One allocation rule's bytes per rank, when they are live, and where the rule comes from.

    `tensors` lists the allocations as (count, bytes each) where the rule knows them, for the
    allocator's per-block rounding; None means one block of `gpu_bytes`. `resident_bytes` is what a
    buffer larger than its data holds of it: a CPU process's resident set counts only the pages written
    (None: all of `gpu_bytes`)."""

    gpu_bytes: int
    source: str
    phases: tuple[str, ...] = BOTH
    cpu_bytes: int = 0
    tensors: list[tuple[int, int]] | None = None
    resident_bytes: int | None = None

    @property
    def resident(self) -> int:
        return self.gpu_bytes if self.resident_bytes is None else self.resident_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"gpu_bytes": int(self.gpu_bytes), "cpu_bytes": int(self.cpu_bytes),
                "resident_bytes": int(self.resident), "phases": list(self.phases), "source": self.source}


@dataclass(slots=True, kw_only=True)
class ZeroSettings:
    """The DeepSpeed ZeRO settings the rows read: the recipe's `deepspeed:` values, DeepSpeed's defaults otherwise."""

    stage: int
    reduce_bucket_size: int
    allgather_bucket_size: int
    contiguous_gradients: bool
    overlap_comm: bool
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    param_persistence_threshold: int
    model_persistence_threshold: int
    sub_group_size: int
    grad_bytes: int  # data_types.grad_accum_dtype; the model dtype unless set
    comm_bytes: int  # communication_data_type; the model dtype unless set


def zero_settings(recipe: Recipe) -> ZeroSettings:
    """Resolve `deepspeed.zero_optimization` with DeepSpeed's own config model (deepspeed/runtime/zero/config.py)."""
    section = {**recipe.deepspeed.get("zero_optimization", {}), "stage": recipe.engine.zero_stage}
    with quiet_deepspeed():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    try:
        z = DeepSpeedZeroConfig(**section)
    except Exception as exc:  # pydantic's ValidationError: an unknown key or a value out of range
        error = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
        key = ".".join(["deepspeed.zero_optimization", *map(str, error["loc"])])
        raise RecipeError(f"recipe key '{key}': DeepSpeed's ZeRO config refuses it ({error['msg']}); "
                          "fix or remove the key") from None
    model_b = DTYPE_BYTES[recipe.model.dtype]
    grad = recipe.deepspeed.get("data_types", {}).get("grad_accum_dtype")
    comm = recipe.deepspeed.get("communication_data_type")
    return ZeroSettings(
        stage=int(z.stage), reduce_bucket_size=int(z.reduce_bucket_size),
        allgather_bucket_size=int(z.allgather_bucket_size), contiguous_gradients=bool(z.contiguous_gradients),
        overlap_comm=bool(z.overlap_comm), prefetch_bucket_size=int(z.prefetch_bucket_size),
        max_live_parameters=int(z.max_live_parameters), max_reuse_distance=int(z.max_reuse_distance),
        param_persistence_threshold=int(z.param_persistence_threshold),
        model_persistence_threshold=int(z.model_persistence_threshold), sub_group_size=int(z.sub_group_size),
        grad_bytes=DTYPE_BYTES.get(grad, model_b), comm_bytes=DTYPE_BYTES.get(comm, model_b),
    )


# ---------------------------------------------------------------------------------------------
# Rows live in the phases: model states, activations and what the engine adds
# ---------------------------------------------------------------------------------------------


def _grads_live_through_forward(recipe: Recipe) -> tuple[bool, str]:
    """Whether the gradient row is live at the forward/backward turn, and why."""
    e = recipe.engine
    if recipe.train.grad_accum > 1:
        return True, "live in every phase: gradients accumulate across the step's micro batches"
    if e.kind == "deepspeed" and e.zero_stage == 3:
        return True, ("allocated once (zero/stage3.py DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer: "
                      "grad_partitions_flat_buffer), live in every phase")
    if e.kind == "deepspeed" and e.zero_stage in (1, 2):
        return False, ("made during backward and freed by step() (zero/stage_1_and_2.py: param.grad, "
                       "grads_in_partition): not live at the forward/backward turn")
    if e.kind == "deepspeed":
        return True, "assumed live in every phase (DeepSpeed without ZeRO keeps gradient buffers; not checked)"
    engine_file = "engines/fsdp_engine.py" if e.kind == "fsdp" else "engines/torch_engine.py"
    return False, (f"freed by optimizer.zero_grad(set_to_none=True) after each step ({engine_file}): "
                   "not live at the forward/backward turn")


def _grads_row(recipe: Recipe, per_rank: dict[str, Any], per_param: list[tuple[int, int]] | None) -> MemoryRow:
    e = recipe.engine
    if e.kind == "deepspeed" and e.zero_stage >= 1 and e.offload != "none":
        return MemoryRow(gpu_bytes=0, phases=(OPT_STEP,), source=(
            "0 on the GPU (model_states.per_rank.grads counts them there as an upper bound): with ZeRO-Offload "
            "stage 3 allocates grad_partitions_flat_buffer on the CPU (zero/stage3.py __init__ self.device, "
            "_setup_for_real_optimizer) and stages 1/2 copy each reduced bucket into the pinned fp32 partition "
            "(zero/stage_1_and_2.py copy_grads_in_partition); offload_pinned_buffers counts them"))
    grads_live, why = _grads_live_through_forward(recipe)
    return MemoryRow(gpu_bytes=per_rank["grads"]["gpu_bytes"], phases=BOTH if grads_live else (OPT_STEP,),
                     source=f"model_states.per_rank.grads; {why}", tensors=per_param)


def _state_rows(recipe: Recipe, per_rank: dict[str, Any], census: dict[str, Any]) -> dict[str, MemoryRow]:
    per_param = None
    if recipe.engine.kind == "torch":  # one fp32 tensor per trainable parameter, not ZeRO's flat buffers
        per_param = [(1, 4 * n) for group in census["group_numels"] for n in group]
    whole = per_param if census["trainable"] == census["total"] else None
    return {
        "params": MemoryRow(gpu_bytes=per_rank["params"]["gpu_bytes"], source="model_states.per_rank.params",
                            tensors=whole),
        "grads": _grads_row(recipe, per_rank, per_param),
        "optimizer_states": MemoryRow(
            gpu_bytes=per_rank["optimizer"]["gpu_bytes"], source="model_states.per_rank.optimizer",
            tensors=None if per_param is None else per_param * 2),
    }


def _activation_rows(activations: dict[str, Any], saved: SavedTensors, layers: int) -> dict[str, MemoryRow]:
    used = activations["used"]
    loss = _loss_row(activations, saved)
    if used != "full_recompute":
        tensors = [(count * layers, nbytes) for count, nbytes in saved.layer] + saved.head
        return {"activations": MemoryRow(gpu_bytes=activations["hf_llama"][used]["value"], phases=(FWD_BWD,),
                                         source=f"activations.hf_llama.{used}", tensors=tensors),
                "logits_loss": loss}
    # Full recomputation: at the turn the layers' inputs, the final norm's and the loss's tensors are live; a
    # layer re-runs only once the loss's backward is over, so its activations raise the phase's peak only by
    # what they exceed the loss's and the final norm's
    kept = [(layers, saved.layer_input), *saved.head]
    rerun = tensor_bytes(saved.layer)
    excess = max(0, rerun - loss.gpu_bytes - tensor_bytes(saved.head))
    return {
        "activations": MemoryRow(gpu_bytes=tensor_bytes(kept), phases=(FWD_BWD,), tensors=kept,
                                 source="activations.hf_llama.full_recompute less its one re-run layer: the "
                                        "layers' inputs and the final norm's tensors"),
        "logits_loss": loss,
        "recompute_layer": MemoryRow(
            gpu_bytes=excess, phases=(FWD_BWD,), tensors=saved.layer if excess else [],
            source=(f"the layer re-running in backward ({rerun:,} B saved) beyond the loss's and final norm's "
                    f"tensors it follows ({loss.gpu_bytes + tensor_bytes(saved.head):,} B): the two are never "
                    "live together (H100, ZeRO-3 32 x 1024: the peak held the loss's 3 fp32 s*b*V tensors and "
                    "no re-run layer, docs/memory.md)")),
    }


def _frozen_head_rows(rows: dict[str, MemoryRow], saved: SavedTensors) -> dict[str, MemoryRow]:
    """LoRA/QLoRA at ZeRO-1/2: the LM head is frozen, so the first gradient (which allocates the reduce
    bucket) comes in the last decoder layer's backward, after the loss's backward tensors are freed. The
    loss's tensors and the bucket are never live together; a re-running layer is, with the bucket (H200,
    Llama2-7B LoRA: the peak held the bucket and 31 layers' activations and no loss tensor; H100, QLoRA:
    the bucket, a re-run layer and a dequantized weight; docs/memory.md)."""
    bucket, loss = rows["zero_reduce_bucket"].gpu_bytes, rows["logits_loss"].gpu_bytes
    rerun = tensor_bytes(saved.layer) if "recompute_layer" in rows else 0
    out = {"logits_loss": MemoryRow(
        gpu_bytes=max(0, loss - bucket - rerun), phases=(FWD_BWD,),
        tensors=rows["logits_loss"].tensors if loss > bucket + rerun else [],
        source=(f"the loss's tensors ({loss:,} B) beyond the reduce bucket and re-run layer that follow them "
                f"({bucket + rerun:,} B): with the LM head frozen the first gradient, which allocates the bucket, "
                "comes after the loss's backward"))}
    if rerun:
        out["recompute_layer"] = MemoryRow(
            gpu_bytes=rerun, phases=(FWD_BWD,), tensors=saved.layer,
            source=f"the layer re-running in backward ({rerun:,} B saved), live with the reduce bucket")
    return out


def _dequantized_weight(recipe: Recipe) -> MemoryRow:
    """QLoRA dequantizes each 4-bit base weight to the compute dtype for its GEMM and frees it after: at
    most the largest linear's copy is live (H100, Llama2-7B QLoRA: an h x I copy at the peak)."""
    shape = resolve_shape(recipe.model)
    nbytes = shape.hidden_size * shape.intermediate_size * DTYPE_BYTES[recipe.model.dtype]
    return MemoryRow(gpu_bytes=nbytes, phases=(FWD_BWD,), source=(
        f"h x I x {DTYPE_BYTES[recipe.model.dtype]} B: the largest base linear dequantized for its GEMM, freed after "
        "(bitsandbytes backends/cuda/ops.py _dequant_linear_fallback)"))


def _loss_row(activations: dict[str, Any], saved: SavedTensors) -> MemoryRow:
    """The larger of the loss's forward tensors and those live as backward starts (HF ForCausalLMLoss's
    cross_entropy: log_softmax_backward holds nll_loss's gradient, its saved output and its own gradient,
    3 fp32 s*b*V tensors)."""
    forward, backward = activations["logits_loss"]["value"], tensor_bytes(saved.loss_backward)
    if forward >= backward:
        return MemoryRow(gpu_bytes=forward, phases=(FWD_BWD,), source="activations.logits_loss (the forward's)",
                         tensors=saved.logits)
    return MemoryRow(gpu_bytes=backward, phases=(FWD_BWD,), tensors=saved.loss_backward,
                     source=("s*b*V*12 as backward starts, above activations.logits_loss: HF's cross_entropy "
                             "backward holds nll_loss's fp32 gradient, log_softmax's saved fp32 output and the fp32 "
                             "gradient log_softmax_backward makes at once"))


def _torch_rows(recipe: Recipe, census: dict[str, Any], world_size: int) -> dict[str, MemoryRow]:
    """The torch engine: autocast's weight copies, AdamW's foreach temporary and DDP's buckets."""
    dtype, trainable = recipe.model.dtype, census["trainable"]
    rows = {}
    if dtype != "fp32":
        rows["autocast_weight_copies"] = MemoryRow(
            gpu_bytes=DTYPE_BYTES[dtype] * census["matmul_trainable"], phases=(FWD_BWD,),
            source=(f"{DTYPE_BYTES[dtype]} B x {census['matmul_trainable']:,} trainable matmul weights: torch.autocast "
                    f"casts each fp32 weight to {dtype} once per forward and caches the copy while the region "
                    "lasts (torch/amp/autocast_mode.py, cache_enabled=True); the linears save it for backward"))
    if recipe.optimizer.state_bits == 32:
        rows["optimizer_step_transient"] = MemoryRow(
            gpu_bytes=4 * trainable, phases=(OPT_STEP,),
            source=("4 B x trainable params: torch.optim.AdamW runs foreach on CUDA (optim/optimizer.py "
                    "_default_to_fused_or_foreach) and _multi_tensor_adam makes exp_avg_sq_sqrt = "
                    "torch._foreach_sqrt(exp_avg_sqs), an fp32 copy of every second moment (optim/adam.py)"))
    else:
        rows["optimizer_step_transient"] = MemoryRow(
            gpu_bytes=0, phases=(OPT_STEP,),
            source="not modelled: torchao's compiled quantized AdamW dequantizes per tensor (unmeasured)")
    if world_size > 1 and recipe.engine.pipeline_stages == 1:
        rows["ddp_buckets"] = MemoryRow(
            gpu_bytes=4 * trainable,
            source=("4 B x trainable params: DistributedDataParallel's reducer keeps its own flat bucket of every "
                    "fp32 gradient from construction on (gradient_as_bucket_view=False, the default; its docs: "
                    "views save 'the total gradients size'; torch/csrc/distributed/c10d/reducer.cpp)"))
    return rows


def _fsdp_rows(recipe: Recipe, census: dict[str, Any], world_size: int, per_rank: dict[str, Any]) -> dict[str, MemoryRow]:
    """FSDP2 (engines/fsdp_engine.py): the gathered parameters and AdamW's foreach temporary over the shards.
    No autocast copies (the MixedPrecisionPolicy all-gathers in the compute dtype) and no DDP buckets."""
    on_cpu = recipe.engine.offload == "optimizer+params"
    gathered = per_rank["gathered"]
    return {
        "fsdp_gathered_params": MemoryRow(gpu_bytes=gathered["gpu_bytes"], phases=(FWD_BWD,),
                                          source=f"model_states.per_rank.gathered: {gathered['source']}"),
        "optimizer_step_transient": MemoryRow(
            gpu_bytes=0 if on_cpu else math.ceil(4 * census["trainable"] / world_size), phases=(OPT_STEP,),
            source=("0: CPUOffloadPolicy runs the optimizer step on the host" if on_cpu else
                    f"4 B x trainable params / {world_size}: AdamW's foreach exp_avg_sq sqrt copy (optim/adam.py), "
                    "over this rank's shards")),
    }


# ---------------------------------------------------------------------------------------------
# DeepSpeed ZeRO: buckets, the gathered-parameter window, persistent params, the step's flat copies
# ---------------------------------------------------------------------------------------------


def _partition(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size)


def _sub_groups(group_numels: list[list[int]], world_size: int, sub_group_size: int) -> list[int]:
    """Partition elements of each ZeRO-3 optimizer sub group: per param group, params are taken in order
    until a sub group holds sub_group_size partition elements (stage3.py _create_fp16_sub_groups)."""
    sizes = []
    for group in group_numels:
        current = 0
        for i, numel in enumerate(group):
            current += _partition(numel, world_size)
            if current >= sub_group_size or i == len(group) - 1:
                sizes.append(current)
                current = 0
    return sizes


def _reduce_bucket(recipe: Recipe, z: ZeroSettings, trainable: int) -> MemoryRow:
    n = z.reduce_bucket_size
    filled = min(n, trainable)  # a bucket holds at most every trainable gradient
    if z.stage == 3:
        return MemoryRow(
            gpu_bytes=n * z.comm_bytes if z.contiguous_gradients else 0,
            resident_bytes=filled * z.comm_bytes if z.contiguous_gradients else 0,
            source=(f"reduce_bucket_size {n:,} x {z.comm_bytes} B: one gradient bucket per communication dtype, "
                    "allocated once when contiguous_gradients (zero/stage3.py "
                    "DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer)"))
    model_b = DTYPE_BYTES[recipe.model.dtype]
    # fp32 accumulation at stage 1 reduces in an fp32 buffer (use_grad_accum_attribute)
    bucket_b = z.grad_bytes if z.stage == 1 and z.grad_bytes != model_b else model_b
    used = z.contiguous_gradients or recipe.engine.offload != "none"
    buffers = (2 if z.overlap_comm else 1) if used else 0
    return MemoryRow(
        gpu_bytes=buffers * n * bucket_b, resident_bytes=buffers * filled * bucket_b, phases=(FWD_BWD,),
        source=(f"{buffers} x reduce_bucket_size {n:,} x {bucket_b} B (a second buffer with overlap_comm), "
                "allocated as backward starts and freed at its end (zero/stage_1_and_2.py "
                "DeepSpeedZeroOptimizer.setup_buckets, _release_ipg_buffers)"))


def _allgather_bucket(z: ZeroSettings) -> MemoryRow:
    return MemoryRow(
        gpu_bytes=0, phases=(OPT_STEP,),
        source=(f"allgather_bucket_size {z.allgather_bucket_size:,} allocates nothing: after the step each rank's "
                "partition is gathered in place into the flat 16-bit groups with all_gather_into_tensor "
                "(runtime/utils.py all_gather_dp_groups -> all_gather_into_tensor_dp_groups); the bucket "
                "only shards the fallback without it"))


def _partitioned_modules(module_numels: list[list[int]], z: ZeroSettings) -> tuple[list[int], int]:
    """Each module's partitioned (gathered-on-use) elements, and the persistent elements: a param of at most
    param_persistence_threshold elements stays whole on every rank while the persisted total stays under
    model_persistence_threshold (zero/partition_parameters.py Init._convert_to_deepspeed_param, ds_persist)."""
    persistent, modules = 0, []
    for numels in module_numels:
        gathered = 0
        for numel in numels:
            if numel <= z.param_persistence_threshold and persistent + numel <= z.model_persistence_threshold:
                persistent += numel
            else:
                gathered += numel
        modules.append(gathered)
    return modules, persistent


def _kept_at_turn(modules: list[int], reuse: int) -> int:
    """Elements still gathered as backward starts. A module's parameters are released after it runs unless
    the trace reaches their next use within `reuse` elements; from a forward module that next use is its
    backward, after the rest of the forward and the backward of those modules: twice the elements after it
    (PartitionedParameterCoordinator.__params_to_release). Backward then starts by fetching the last
    module again, so it is gathered either way."""
    kept = after = 0
    for numel in reversed(modules):
        kept += numel if 2 * after < reuse else 0
        after += numel
    last = next((numel for numel in reversed(modules) if numel), 0)
    return max(kept, last)


def _zero3_gathered(recipe: Recipe, z: ZeroSettings, census: dict[str, Any], n: int) -> dict[str, MemoryRow]:
    b = DTYPE_BYTES[recipe.model.dtype]
    modules, persistent = _partitioned_modules(census["module_numels"], z)
    partitioned = sum(modules)
    if n == 1:
        why = ("0: one rank holds whole partitions and DeepSpeed points each parameter at its partition instead "
               "of gathering a copy (zero/partition_parameters.py _no_gather_coalesced)")
        return {key: MemoryRow(gpu_bytes=0, phases=(FWD_BWD,), source=why)
                for key in ("zero3_gathered_params", "zero3_prefetch", "zero3_persistent_params")}
    reuse, live = z.max_reuse_distance, z.max_live_parameters
    kept = _kept_at_turn(modules, reuse)
    ahead = min(partitioned, max(kept, live)) - kept if z.prefetch_bucket_size > 0 else 0
    return {
        "zero3_gathered_params": MemoryRow(
            gpu_bytes=b * kept, phases=(FWD_BWD,),
            source=(f"{kept:,} params x {b} B gathered as backward starts: a module's parameters stay gathered "
                    f"when their backward use comes within stage3_max_reuse_distance {reuse:,} elements of the "
                    "trace, i.e. when twice the partitioned params after the module are fewer (partitioned_param_"
                    "coordinator.py PartitionedParameterCoordinator.__params_to_release), plus the last module, "
                    "which backward fetches first")),
        "zero3_prefetch": MemoryRow(
            gpu_bytes=b * ahead, phases=(FWD_BWD,),
            source=(f"{ahead:,} params x {b} B more: with stage3_prefetch_bucket_size {z.prefetch_bucket_size:,} > 0 "
                    f"the prefetcher fetches ahead while fewer than stage3_max_live_parameters {live:,} are live "
                    "(PartitionedParameterCoordinator.fetch_sub_module), and its bookkeeping "
                    "(__most_recent_step_id_param_fetched_for, read by __params_to_release) keeps what it fetched "
                    "gathered: the window grows to max_live_parameters, at most the partitioned params, even with "
                    "no reuse distance (DeepSpeed 0.19.8 on 2 CPU ranks: tests/test_plan_deepspeed_buffers.py)")),
        "zero3_persistent_params": MemoryRow(
            gpu_bytes=math.ceil(b * persistent * (1 - 1 / n)),
            source=(f"(1 - 1/{n}) x {persistent:,} params x {b} B: params of at most "
                    f"stage3_param_persistence_threshold {z.param_persistence_threshold:,} elements stay whole on "
                    "every rank (partition_parameters.py Init._convert_to_deepspeed_param, ds_persist), beyond "
                    "the params row's 1/n share")),
    }


def _zero_step_transient(recipe: Recipe, z: ZeroSettings, census: dict[str, Any], n: int) -> MemoryRow:
    """The flat copies of the gradient partition the ZeRO step makes before the inner optimizer runs."""
    if recipe.engine.offload != "none":
        return MemoryRow(gpu_bytes=0, phases=(OPT_STEP,),
                         source="0: ZeRO-Offload steps on the CPU from gradients already copied there")
    model_b, g = DTYPE_BYTES[recipe.model.dtype], z.grad_bytes
    if z.stage == 3:
        largest = max(_sub_groups(census["group_numels"], n, z.sub_group_size))
        per = g + 4 if g != 4 else 4
        rule = (f"largest optimizer sub group ({largest:,} partition elements; sub_group_size "
                f"{z.sub_group_size:,}, stage3.py _create_fp16_sub_groups) x ({g} B flatten + 4 B fp32 copy): "
                "stage3.py _prepare_fp32_grad_for_sub_group flattens its gradients and upcasts them")
    else:
        largest = max(_partition(sum(group), n) for group in census["group_numels"])
        per = 0 if g == 4 and model_b != 4 else (g + 4 if g != 4 else 4)  # fp32 accumulation is pre-flattened
        rule = (f"largest param group partition ({largest:,} elements) x ({g} B flatten + 4 B fp32 copy): "
                "zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step flattens averaged_gradients[i] and upcasts it")
    inner = "" if recipe.optimizer.state_bits == 32 else "; the torchao inner optimizer's own temporaries are not modelled"
    return MemoryRow(gpu_bytes=per * largest, phases=(OPT_STEP,), source=rule + inner,
                     tensors=[(1, g * largest), (1, 4 * largest)] if per else [])


def _pinned(nbytes: int) -> int:
    """Host bytes PyTorch's pinned-memory allocator takes for one buffer: the next power of two
    (ATen/core/CachingHostAllocator.h CachingHostAllocatorImpl::allocate)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0


def _offload_row(recipe: Recipe, z: ZeroSettings, census: dict[str, Any], n: int) -> MemoryRow:
    """ZeRO-Offload's pinned host buffers (trainprof pins them on CUDA: engines/deepspeed_engine.py
    deepspeed_config) and the GPU staging buffer stages 1/2 keep."""
    b, groups = DTYPE_BYTES[recipe.model.dtype], census["group_numels"]
    largest_param = max(numel for group in groups for numel in group)
    if z.stage == 3:
        subs = _sub_groups(groups, n, z.sub_group_size)
        new = [z.grad_bytes * _partition(census["trainable"], n)] + [4 * s for s in subs]
        # offloaded params: one pinned 16-bit buffer per param group (stage3.py _create_param_groups_fp16_flat_cpu_memory)
        counted = ([b * sum(_partition(x, n) for x in g) for g in groups]
                   if recipe.engine.offload == "optimizer+params" else [])
        gpu, what = 0, ("the 16-bit gradient partition (grad_partitions_flat_buffer, on the CPU) and an fp32 "
                        "gradient per sub group (stage3.py initialize_optimizer_states)")
    else:
        parts = [_partition(sum(g), n) for g in groups]
        new = [b * largest_param] + [b * p for p in parts] + [4 * p for p in parts]
        counted = [4 * p for p in parts]  # the fp32 master partitions, in the optimizer row's CPU bytes
        gpu, what = b * largest_param, ("a 16-bit staging copy of the largest param (temp_grad_buffer_for_cpu_offload) "
                                        "and, per param group, a 16-bit param buffer and the fp32 gradient partition "
                                        "(stage_1_and_2.py __init__, initialize_optimizer_states); on the GPU "
                                        "temp_grad_buffer_for_gpu_offload, the largest param in 16 bits")
    host = sum(_pinned(x) for x in new) + sum(_pinned(x) - x for x in counted)
    return MemoryRow(gpu_bytes=gpu, cpu_bytes=host,
                     source=(f"pinned host buffers: {what}; each pinned block is rounded up to a power of two "
                             "(ATen/core/CachingHostAllocator.h), the offloaded states' own blocks included"))


def _deepspeed_rows(recipe: Recipe, census: dict[str, Any], world_size: int) -> dict[str, MemoryRow]:
    if recipe.engine.zero_stage == 0:
        return {"optimizer_step_transient": MemoryRow(
            gpu_bytes=0, phases=(OPT_STEP,),
            source="not modelled: DeepSpeed without ZeRO (BF16_Optimizer / FP16_Optimizer) keeps its own buffers")}
    z = zero_settings(recipe)
    rows = {"zero_reduce_bucket": _reduce_bucket(recipe, z, census["trainable"])}
    if z.stage == 3:
        rows |= _zero3_gathered(recipe, z, census, world_size)
    else:
        rows["zero_allgather_bucket"] = _allgather_bucket(z)
    rows["optimizer_step_transient"] = _zero_step_transient(recipe, z, census, world_size)
    if recipe.engine.offload != "none":
        rows["offload_pinned_buffers"] = _offload_row(recipe, z, census, world_size)
    return rows


# ---------------------------------------------------------------------------------------------
# Peaks and totals
# ---------------------------------------------------------------------------------------------


def allocator_block_bytes(nbytes: int) -> int:
    """Bytes of the caching-allocator block one tensor of `nbytes` takes (see MIN_BLOCK_BYTES above)."""
    unit = ROUND_LARGE_BYTES if nbytes >= MIN_LARGE_ALLOC_BYTES else MIN_BLOCK_BYTES
    return -(-nbytes // unit) * unit


def _rounding(row: MemoryRow) -> int:
    tensors = row.tensors if row.tensors is not None else [(1, row.gpu_bytes)]
    return sum(count * (allocator_block_bytes(nbytes) - nbytes) for count, nbytes in tensors if nbytes)


def _summed(rows: dict[str, MemoryRow], keys: list[str], source: str) -> dict[str, Any]:
    return {"gpu_bytes": sum(rows[k].gpu_bytes for k in keys), "rows": keys, "source": source}


def gpu_memory(recipe: Recipe, world_size: int, census: dict[str, Any], per_rank: dict[str, Any],
               activations: dict[str, Any], saved: SavedTensors, layers: int) -> dict[str, Any]:
    """The plan's `gpu_memory` block: rows, the two phase peaks, the allocated peak and the device total.

    Args:
        recipe: a validated recipe.
        world_size: data-parallel ranks.
        census: trainprof.plan._census of the meta model.
        per_rank: the plan's model_states.per_rank rows.
        activations: the plan's activations block.
        saved: the HF Llama saved tensors those activations sum.
        layers: decoder layers.
    """
    rows = {**_state_rows(recipe, per_rank, census), **_activation_rows(activations, saved, layers)}
    if recipe.engine.kind == "deepspeed":
        rows |= _deepspeed_rows(recipe, census, world_size)
        if recipe.task.kind != "pretrain" and recipe.engine.zero_stage in (1, 2):
            rows |= _frozen_head_rows(rows, saved)
    elif recipe.engine.kind == "fsdp":
        rows |= _fsdp_rows(recipe, census, world_size, per_rank)
    else:
        rows |= _torch_rows(recipe, census, world_size)
    if recipe.task.kind == "qlora":
        rows["qlora_dequantized_weight"] = _dequantized_weight(recipe)
    peaks = {phase: _summed(rows, [k for k, r in rows.items() if phase in r.phases],
                            f"sum of the rows live {label}")
             for phase, label in ((FWD_BWD, "at the forward/backward turn"), (OPT_STEP, "in the optimizer step"))}
    phase = max(peaks, key=lambda p: peaks[p]["gpu_bytes"])
    rows["allocator_rounding"] = MemoryRow(
        gpu_bytes=sum(_rounding(rows[k]) for k in peaks[phase]["rows"]), phases=(),
        source=(f"each tensor live at the {phase} peak rounded to the caching allocator's block (512 B; own "
                "segment rounded to 2 MiB from 10 MiB up: c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp "
                "get_allocation_size); remainders of 1 MiB or less stay in the block and show in "
                "max_memory_allocated too; fragmentation beyond this depends on allocation order and is not modelled"))
    rows["cuda_context"] = MemoryRow(gpu_bytes=CUDA_CONTEXT_BYTES, phases=(), source=CUDA_CONTEXT_SOURCE)
    allocated = {**peaks[phase], "phase": phase,
                 "source": f"the larger phase peak ({phase}): what torch.cuda.max_memory_allocated measures"}
    device = {"gpu_bytes": allocated["gpu_bytes"] + rows["allocator_rounding"].gpu_bytes + CUDA_CONTEXT_BYTES,
              "rows": ["allocated_peak", "allocator_rounding", "cuda_context"],
              "source": "allocated peak + the allocator's block rounding + the CUDA context: the device memory to fit"}
    resident = {"bytes": sum(rows[k].resident for k in peaks[phase]["rows"]), "rows": peaks[phase]["rows"],
                "phase": phase,
                "source": (f"the {phase} peak's rows with each buffer counted as far as its data fills it (a "
                           "reduce bucket larger than the gradients): the tensors a CPU process's resident set "
                           f"holds; {RESIDENT_LEAVES_OUT}")}
    host_rows = [k for k, r in rows.items() if r.cpu_bytes]
    return {
        "rows": {k: r.as_dict() for k, r in rows.items()},
        "peaks": peaks,
        "allocated_peak": allocated,
        "resident_peak": resident,
        "device_total": device,
        "host_total": {"cpu_bytes": per_rank["total"]["cpu_bytes"] + sum(rows[k].cpu_bytes for k in host_rows),
                       "rows": ["model_states.per_rank.total", *host_rows],
                       "source": "model states offloaded to host memory + the pinned buffers beside them"},
    }


def render_gpu_memory(memory: dict[str, Any]) -> list[str]:
    """Plain-text lines for `trainprof plan`."""
    gib = 2**30
    short = {FWD_BWD: "f/b", OPT_STEP: "opt"}
    lines = ["", f"{'GPU memory per rank':<30}{'live in':>10}{'GPU GiB':>10}{'CPU GiB':>10}  source"]
    for key, row in memory["rows"].items():
        live = "+".join(short[p] for p in row["phases"]) or "device"
        lines.append(f"  {key:<28}{live:>10}{row['gpu_bytes'] / gib:>10,.2f}{row['cpu_bytes'] / gib:>10,.2f}  "
                     f"{row['source']}")
    for key, label in ((FWD_BWD, "forward/backward peak"), (OPT_STEP, "optimizer-step peak")):
        peak = memory["peaks"][key]
        lines.append(f"  {label:<28}{'':>10}{peak['gpu_bytes'] / gib:>10,.2f}{'':>10}  {', '.join(peak['rows'])}")
    alloc, device = memory["allocated_peak"], memory["device_total"]
    lines.append(f"  {'allocated peak':<28}{'':>10}{alloc['gpu_bytes'] / gib:>10,.2f}{'':>10}  {alloc['source']}")
    lines.append(f"{'GPU total per rank':<40}{device['gpu_bytes'] / gib:>10,.2f}{'':>10}  {device['source']}")
    host = memory["host_total"]
    lines.append(f"{'Host memory per rank':<40}{'':>10}{host['cpu_bytes'] / gib:>10,.2f}  {host['source']}")
    return lines


def render_resident_memory(memory: dict[str, Any]) -> list[str]:
    """Plain-text lines for `trainprof plan` on a CPU run: each row's resident bytes (a buffer counted as far
    as its data fills it) and the resident-set estimate to compare with the run's peak RSS; the GPU-only rows
    (the caching allocator's rounding, the CUDA context) are left out."""
    gib = 2**30
    short = {FWD_BWD: "f/b", OPT_STEP: "opt"}
    lines = ["", f"{'Host memory per rank (CPU run)':<30}{'live in':>10}{'RSS GiB':>10}  source"]
    for key, row in memory["rows"].items():
        if key in GPU_ONLY_ROWS:
            continue
        live = "+".join(short[p] for p in row["phases"])
        lines.append(f"  {key:<28}{live:>10}{row['resident_bytes'] / gib:>10,.2f}  {row['source']}")
    for key, label in ((FWD_BWD, "forward/backward peak"), (OPT_STEP, "optimizer-step peak")):
        keys = memory["peaks"][key]["rows"]
        nbytes = sum(memory["rows"][k]["resident_bytes"] for k in keys)
        lines.append(f"  {label:<28}{'':>10}{nbytes / gib:>10,.2f}  {', '.join(keys)}")
    lines.append(f"  (left out, GPU only: {', '.join(GPU_ONLY_ROWS)})")
    resident = memory["resident_peak"]
    lines.append(f"{'Resident set per rank':<40}{resident['bytes'] / gib:>10,.2f}  {resident['source']}; "
                 "compare with a CPU run's peak RSS (cpu_process_peak_rss)")
    host = memory["host_total"]
    if host["cpu_bytes"]:
        lines.append(f"{'Offloaded to host per rank':<40}{host['cpu_bytes'] / gib:>10,.2f}  {host['source']}: "
                     "on a CPU run the same process's memory, beside the resident set")
    return lines
