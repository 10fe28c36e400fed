"""Module hooks: when each module call's forward, backward and recompute begin and end.

Forward: a forward pre-hook (registered with prepend=True, so it runs before hooks other libraries put
there, e.g. ZeRO-3's parameter all-gather) and a forward hook (appended last, `always_call=True`, so it
runs after ZeRO-3's release and even when recomputation stops early with an exception).

Recompute: a forward hook that fires while the autograd engine runs a graph task
(`torch._C._current_graph_task_id() != -1`) is a forward re-run inside backward, i.e. activation
recomputation (non-reentrant and reentrant checkpointing alike). transformers >= 5 checkpoints a
layer's `forward`, not its `__call__`, so the layer's own hooks do not fire again; its children's do.
When the model has gradient checkpointing on, modules deeper than `max_depth` get "sentinel" hooks that
only act during a re-run and record it under their nearest profiled ancestor, so a re-run is seen at
any depth; the analysis merges back-to-back re-runs into one burst (see analysis/breakdown.py).

Backward, without touching the module's own hook dicts and without wrapping tensors in autograd
Functions (which would turn in-place ops on module outputs into errors):
  * begin: when the producer node of an output that requires grad is about to run, i.e. when the
    module's last forward op starts its backward.
  * end: the autograd engine runs ready nodes in decreasing sequence number (creation order), so once
    any node created *before* the module call runs, the module's backward is over. Every forward
    pre-hook takes a counter value `pre`, every forward hook a value `post`; the producer of an input
    is watched with `pre`, the producer of an output with `post`. When a node watched with value k is
    about to run, every open backward whose `pre >= k` is closed. Modules whose inputs need no grad
    (frozen LoRA base, embeddings) close at the next such node or at the end of the graph task (an
    engine callback).
One node pre-hook (`Node.register_prehook`) per producer node and step carries a `NodeWatch`: the value
to close from (the first watcher's) and the calls whose backward the node begins, in registration order:
a module's output is usually the next module's input, so this halves the Python calls the engine makes,
and a later input's close is dropped since the node already closes from a smaller value (counter values
only grow). Leaves have no producer node: they get a tensor hook. The node pre-hooks of a forward are
registered together, in one loop, when the outermost profiled call returns (`flush`; also when a
backward region opens): registered one at a time between the forward's tensor ops, each registration
found its code and data evicted from the caches by the op before it and cost 2-3x as much
(scripts/bench_overhead.py --in-situ-only). A forward re-run inside backward (recomputation) registers
at once, since its nodes run right after it. The engine's call on a watched node only stamps its
NodeWatch (time, graph task) and queues it (one stamp per watch: a node runs once per graph task, and a
task's queue is settled when the task ends); the backward stack is settled from that queue in one loop
(`settle`) when the graph task ends, and before anything reads the current module or appends an event,
so the order of the step's events is unchanged. The root module's backward opening (the memory meter
starts its phase there) and operator-traced steps (whose record_function ranges must open live) are
settled at once. This gives nested, properly ordered backward intervals for calls that run twice, for
gradient accumulation (each micro batch has its own counter values) and under ZeRO-3's own hooks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainprof.analysis.records import ModuleInfo
from trainprof.models import logical_numel, recomputes
from trainprof.profiler.compiled import ORIG_MOD, CompiledModules, is_wrapper, profiled_name
from trainprof.profiler.log import B_CLOSE, B_OPEN, F_CLOSE, F_OPEN, R_CLOSE, R_OPEN, StepLog

_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled  # bound once: the hooks call these on every module call
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


# The two records below are made on every module call and watched node: built positionally, since a
# keyword call costs twice as much (docs/profiler.md, "Cost"); eq=False keeps them compared by identity.


@dataclass(slots=True, eq=False)
class ModuleCall:
    """One call of a profiled module: on the forward stack while its forward (or its re-run) is open, then
    on the backward stack from when a watched node begins its backward until that backward closes."""

    module: int  # index into ModuleHooks.modules
    pre: int  # the counter value its forward pre-hook took; -1 for a sentinel's re-run
    recompute: bool  # a forward re-run inside backward
    sentinel: int | None = None  # id() of the module below max_depth whose re-run this records, else None
    rng: Any = None  # the record_function handle of its open range (forward, then backward) while ops are traced
    backward_task: int | None = None  # the graph task its backward opened in; None until it opens


@dataclass(slots=True, eq=False)
class NodeWatch:
    """What happens when the autograd engine is about to run a watched producer node (a leaf's tensor
    hook: when its grad is ready), see the module docstring."""

    serial: int  # the step that watched it: a hook an earlier step left on a node does nothing
    close_from: int  # close every open backward whose `pre` is >= this
    opens: list[ModuleCall]  # the calls whose backward the node begins (its output's modules), in hook order
    reached_at: Any = None  # the stamp the engine's call took, queued until `settle`
    task: int = -1  # the graph task that ran it


def _local_numel(p: torch.Tensor) -> int:
    ds_tensor = getattr(p, "ds_tensor", None)  # ZeRO-3: p.data is empty between gathers
    if ds_tensor is not None:
        return int(ds_tensor.numel())
    return p.to_local().numel() if type(p).__name__ == "DTensor" else p.numel()  # FSDP2: this rank's shard


def _compiled_type(module: torch.nn.Module) -> str:
    """A module's type name; a torch.compile wrapper's is the compiled module's, which runs in its place
    (the wrapper is profiled under the module's name too, see profiler/compiled.py)."""
    while is_wrapper(module):
        module = module._modules[ORIG_MOD]
    return type(module).__name__


def describe_modules(model: torch.nn.Module, max_depth: int) -> list[tuple[ModuleInfo, torch.nn.Module]]:
    """Every module down to `max_depth` (0 = the model), parents before children.

    Args:
        model: the model as the training loop calls it (the peft wrapper for LoRA, engine.module for
            DeepSpeed).
        max_depth: deepest level to include.
    Returns:
        (info, module) pairs; info.index is the position in the list.
    """
    out: list[tuple[ModuleInfo, torch.nn.Module]] = []
    index_of: dict[str, int] = {}
    for name, mod in model.named_modules():
        if name.rpartition(".")[2] == ORIG_MOD:  # a torch.compile wrapper's module: profiled as the wrapper
            continue
        name = profiled_name(name)
        depth = 0 if name == "" else name.count(".") + 1
        if depth > max_depth:
            continue
        parent = -1 if name == "" else index_of.get(name.rpartition(".")[0], 0)
        params = list(mod.parameters())
        info = ModuleInfo(
            index=len(out),
            name=name,
            type=_compiled_type(mod),
            depth=depth,
            parent=parent,
            params=sum(logical_numel(p) for p in params),
            params_trainable=sum(logical_numel(p) for p in params if p.requires_grad),
            params_local=sum(_local_numel(p) for p in params),
        )
        index_of[name] = info.index
        out.append((info, mod))
    return out


def _autocast_dtype() -> torch.dtype | None:
    """The dtype autocast runs matmuls in right now (CUDA first, then CPU), None when it is off."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad in a hook's args/kwargs/output: a tensor, or up to two levels of
    tuple/list/dict (ModelOutput is a dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if type(obj) is tuple and len(obj) == 1 and isinstance(obj[0], torch.Tensor):  # the common (x,) args
        return [obj[0]] if obj[0].requires_grad else []
    found: list[torch.Tensor] = []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(t for t in item if isinstance(t, torch.Tensor) and t.requires_grad)
        elif isinstance(item, dict):
            found.extend(t for t in item.values() if isinstance(t, torch.Tensor) and t.requires_grad)
    return found


def attach_forward_hooks(described: list[tuple[ModuleInfo, torch.nn.Module]], pre: Callable[..., None],
                         post: Callable[..., None]) -> list[torch.utils.hooks.RemovableHandle]:
    """Register `pre(index, module, args, kwargs)` first among each module's forward pre-hooks and
    `post(index, module, args, kwargs, output)` last among its forward hooks, called even when the
    forward raises (see the module docstring).

    Returns:
        The handles, to remove them.
    """
    handles = []
    for info, mod in described:
        handles.append(mod.register_forward_pre_hook(functools.partial(pre, info.index), prepend=True,
                                                     with_kwargs=True))
        handles.append(mod.register_forward_hook(functools.partial(post, info.index), with_kwargs=True,
                                                 always_call=True))
    return handles


class ModuleHooks:
    """Installs the forward hooks on every module down to a depth and records module events into a
    StepLog. `close()` removes exactly the hooks it added.

    Args:
        model: the model the loop calls.
        max_depth: deepest module level timed.
        log: the step record the hooks append to.
        now: the timer's stamp function.
        on_root: called as on_root(phase, begin) when the model's own forward/backward begins or
            ends (memory tracking uses it); None for no callback.
        recompute_sentinels: hook modules deeper than max_depth to see re-runs (None: when the model
            says gradient checkpointing is on, `model.is_activation_checkpointing` or, before
            transformers 5.x, `model.is_gradient_checkpointing`).
    """

    def __init__(self, model: torch.nn.Module, max_depth: int, log: StepLog, now: Callable[[], Any],
                 on_root: Callable[[str, bool], None] | None = None, recompute_sentinels: bool | None = None) -> None:
        self.log = log
        self.now = now
        self.on_root = on_root
        described = describe_modules(model, max_depth)
        self.modules: list[ModuleInfo] = [info for info, _ in described]
        # torch.compile'd regions are timed around their compiled call and nothing inside them is hooked
        # (dynamo would trace the hooks and run the region eagerly): see profiler/compiled.py
        self.compiled = CompiledModules.find(model)
        # by index: a caller may rename self.modules (Profiler's module_names)
        self.inside_regions = [info.index for info in self.modules if info.name in self.compiled.inside_names]
        self.counter = 0
        self.forward_stack: list[ModuleCall] = []  # open forward calls and re-runs, innermost last
        self.backward_stack: list[ModuleCall] = []  # open backwards, `pre` increasing up the stack
        self.callback_tasks: set[int] = set()
        self.pending: list[NodeWatch] = []  # nodes the engine reached, not yet settled
        self.watched: dict[Any, NodeWatch] = {}  # this step's watched producer nodes
        self.unregistered: list[Any] = []  # watched nodes whose pre-hook `flush` registers
        self.serial = 0  # a hook left on a node or leaf by an earlier step does nothing
        self.range_names: list[dict[str, str]] | None = None  # set while operator tracing is on
        self.autocast_dtype: torch.dtype | None = None  # the root forward's autocast dtype, if any
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._handles.extend(attach_forward_hooks(self.compiled.hookable(described), self._pre, self._post))
        self._handles.extend(self.compiled.attach(described, self._pre, self._post))
        if recompute_sentinels is None:  # DDP does not forward attributes: ask the module it wraps
            inner = getattr(model, "module", model)
            inner = getattr(inner, ORIG_MOD, inner)  # a torch.compile wrapper: ask the compiled module
            recompute_sentinels = recomputes(inner)
        if recompute_sentinels:
            index_of = {info.name: info.index for info in self.modules}
            for name, mod in model.named_modules():
                if name in index_of or name == "" or id(mod) in self.compiled.inside:
                    continue
                owner = name
                while owner not in index_of:
                    owner = owner.rpartition(".")[0]
                pre = functools.partial(self._sentinel_pre, index_of[owner])
                post = functools.partial(self._sentinel_post, index_of[owner])
                self._handles.append(mod.register_forward_pre_hook(pre, prepend=True))
                self._handles.append(mod.register_forward_hook(post, always_call=True))

    # -- state shared with comm / flops / ops ------------------------------------------------------

    def current(self) -> tuple[int, str | None]:
        """The innermost open module call and its phase, (-1, None) outside the model."""
        if self.pending:
            self.settle()
        if self.forward_stack:
            top = self.forward_stack[-1]
            return top.module, "recompute" if top.recompute else "forward"
        if self.backward_stack:
            return self.backward_stack[-1].module, "backward"
        return -1, None

    def reset_step(self) -> None:
        self.serial += 1
        self.watched = {}
        self.unregistered = []
        self.pending = []
        self.callback_tasks.clear()
        self.forward_stack.clear()
        self.backward_stack.clear()

    def end_step(self) -> None:
        """Settle what the engine reported, and drop any node a forward left unflushed."""
        if self.pending:
            self.settle()
        self.watched = {}
        self.unregistered = []

    def flush(self) -> None:
        """Register the pre-hooks of the nodes watched since the last flush, in one loop (see the module
        docstring); called when the outermost profiled forward call returns, after each call of a re-run
        inside backward, and when a backward region opens.

        Once no profiled call is open, the nodes are let go: a node keeps its graph's saved tensors alive,
        and a re-run's graph under non-reentrant checkpointing is never run backward, so holding its nodes
        to the step's end held every recomputed activation of the step (the GPU peaks of docs/memory.md)."""
        nodes = self.unregistered
        if nodes:
            self.unregistered = []
            watched = self.watched
            queue, at_once = self._on_grad, self._on_grad_now
            if self.range_names is not None:  # operator tracing: backward ranges open and close live
                queue = at_once
            for node in nodes:
                watch = watched[node]
                live = watch.opens and any(call.module == 0 for call in watch.opens)  # the root's backward (memory meter)
                node.register_prehook(functools.partial(at_once if live else queue, watch))
        if not self.forward_stack and self.watched:
            # a node watched again later gets a second pre-hook; it closes from a later counter value, so
            # only backwards its first already closes
            self.watched = {}

    def settle(self) -> None:
        """Apply the queued engine calls to the backward stack, in the order the engine made them. The
        hooks check `pending` first themselves (a call less on their path)."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        for watch in pending:
            self._apply(watch)

    def modules_inside_regions(self) -> list[dict[str, str]]:
        """The modules down to the profiled depth that run inside a compiled region, {name, type}: they
        have no own times (profile.json compile.modules_inside), and the report says where their time went."""
        return [{"name": self.modules[i].name, "type": self.modules[i].type} for i in self.inside_regions]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward -----------------------------------------------------------------------------------

    def _pre(self, mi: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        log = self.log
        if not log.active:
            return None
        if self.pending:  # a re-run inside backward: the engine calls before it come first
            self.settle()
        t = self.now()
        recompute = _graph_task_id() != -1
        k = self.counter
        self.counter = k + 1
        log.codes.append(R_OPEN if recompute else F_OPEN)  # the log's columns (see StepLog)
        log.subjects.append(mi)
        log.stamps.append(t)
        call = ModuleCall(mi, k, recompute)
        if self.range_names is not None:
            call.rng = torch.ops.profiler._record_function_enter_new(
                self.range_names[mi]["recompute" if recompute else "forward"], None)
        self.forward_stack.append(call)
        if mi == 0 and not recompute:
            if _grad_enabled():  # an evaluation forward (no_grad, inference_mode) trains on no tokens
                self._count_tokens(args, kwargs)
            self.autocast_dtype = _autocast_dtype()
            if self.on_root is not None:
                self.on_root("forward", True)
        if _grad_enabled():
            tensors = _grad_tensors(args)
            if kwargs:
                tensors += _grad_tensors(kwargs)
            if tensors:
                self._watch(tensors, k, None)
                if recompute:  # a re-run inside backward: its nodes run next
                    self.flush()
        return None

    def _post(self, mi: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        log = self.log
        forward_stack = self.forward_stack
        if not log.active or not forward_stack:
            return None
        call = forward_stack[-1]
        if call.module != mi or call.sentinel is not None:  # not this module's call (a sentinel's re-run is open)
            return None
        if self.pending:
            self.settle()
        recompute = call.recompute
        if mi == 0 and not recompute and self.on_root is not None:
            self.on_root("forward", False)  # before the stamp: reading the memory meter can take ms (CPU)
        t = self.now()
        forward_stack.pop()
        log.codes.append(R_CLOSE if recompute else F_CLOSE)
        log.subjects.append(mi)
        log.stamps.append(t)
        if call.rng is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(call.rng)
            call.rng = None
        post = self.counter
        self.counter = post + 1
        if output is not None and _grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                self._watch(tensors, post, call)
        if recompute or not forward_stack:  # a re-run inside backward (its nodes run next), or the outermost returned
            self.flush()
        return None

    def _sentinel_pre(self, mi: int, module: torch.nn.Module, args: tuple) -> None:
        """A module below max_depth starts: record only the outermost re-run, under its profiled ancestor."""
        if not self.log.active or _graph_task_id() == -1 or (self.forward_stack and self.forward_stack[-1].recompute):
            return None
        if self.pending:
            self.settle()
        self.log.mark(R_OPEN, mi, self.now())
        self.forward_stack.append(ModuleCall(mi, -1, True, id(module)))
        return None

    def _sentinel_post(self, mi: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self.forward_stack
        if not self.log.active or not stack or stack[-1].sentinel != id(module):
            return None
        stack.pop()
        if self.pending:
            self.settle()
        self.log.mark(R_CLOSE, mi, self.now())
        return None

    def _count_tokens(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids") if kwargs else None
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if isinstance(ids, torch.Tensor):
            self.log.tokens_seen += ids.numel()
            self.log.seq_len = int(ids.shape[-1]) if ids.dim() else None

    # -- backward ----------------------------------------------------------------------------------

    def _watch(self, tensors: list[torch.Tensor], close_from: int, call: ModuleCall | None) -> None:
        """When each tensor's producer node is about to run in backward, close the backwards from
        `close_from` and begin `call`'s backward (None: a module's inputs, which only close), see the
        module docstring."""
        watched = self.watched
        for x in tensors:
            node = x.grad_fn
            watch = watched.get(node) if node is not None else None
            if watch is not None:
                if call is not None:  # a later close is covered by the node's first close_from
                    watch.opens.append(call)
                continue
            watch = NodeWatch(self.serial, close_from, [call] if call is not None else [])
            if node is None:  # a leaf that requires grad (an input made to require it)
                x.register_hook(functools.partial(self._on_grad_now, watch))
            else:
                watched[node] = watch
                self.unregistered.append(node)  # registered by flush() before backward

    def _on_grad(self, watch: NodeWatch, grads: Any) -> None:
        """A watched node is about to run: stamp it and queue it for `settle`."""
        if watch.serial != self.serial or not self.log.active:
            return None
        task = _graph_task_id()
        watch.reached_at = self.now()
        watch.task = task
        self.pending.append(watch)
        if task not in self.callback_tasks:
            self._follow(task)
        return None

    def _on_grad_now(self, watch: NodeWatch, grads: Any) -> None:
        """A watched node whose effect must be applied as it runs: the root's, those of an
        operator-traced step (see `flush`), and a leaf's tensor hook (rare: an input made to require grad)."""
        if watch.serial != self.serial or not self.log.active:
            return None
        if self.pending:
            self.settle()
        task = _graph_task_id()
        if task not in self.callback_tasks:
            self._follow(task)
        watch.reached_at = self.now()
        watch.task = task
        self._apply(watch)
        return None

    def _follow(self, task: int) -> None:
        """Have the engine call `_graph_task_end` when this graph task finishes (only during it can one ask)."""
        self.callback_tasks.add(task)
        _queue_callback(functools.partial(self._graph_task_end, task))

    def _apply(self, watch: NodeWatch) -> None:
        """Close the backwards the node closes, then open those of the calls whose output it produced
        (their forward hooks ran in this order), each call's once."""
        t = watch.reached_at
        stack = self.backward_stack
        k = watch.close_from
        while stack and stack[-1].pre >= k:
            self._pop_backward(t)
        for call in watch.opens:
            if call.backward_task is None:
                self._open_backward(call, t, watch.task)

    def _open_backward(self, call: ModuleCall, t: Any, task: int) -> None:
        call.backward_task = task
        stack = self.backward_stack
        # A module returning its child's output (or the same tensor as a sibling) is opened after the
        # child on that node: it goes below the child, keeping `pre` increasing up the stack.
        i = len(stack)
        pre = call.pre
        while i and stack[i - 1].pre > pre:
            i -= 1
        if self.range_names is not None:
            above = stack[i:]
            for entry in reversed(above):  # ranges must nest: reopen the children inside this one
                torch.ops.profiler._record_function_exit._RecordFunction(entry.rng)
            call.rng = torch.ops.profiler._record_function_enter_new(self.range_names[call.module]["backward"], None)
            for entry in above:
                entry.rng = torch.ops.profiler._record_function_enter_new(
                    self.range_names[entry.module]["backward"], None)
        stack.insert(i, call)
        log = self.log
        log.codes.append(B_OPEN)
        log.subjects.append(call.module)
        log.stamps.append(t)
        if call.module == 0 and self.on_root is not None:
            self.on_root("backward", True)

    def _pop_backward(self, t: Any) -> None:
        call = self.backward_stack.pop()
        log = self.log
        log.codes.append(B_CLOSE)
        log.subjects.append(call.module)
        log.stamps.append(t)
        if call.rng is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(call.rng)
            call.rng = None
        if call.module == 0 and self.on_root is not None:
            self.on_root("backward", False)

    def _graph_task_end(self, task: int) -> None:
        self.callback_tasks.discard(task)
        if not self.log.active:
            return
        if self.pending:
            self.settle()
        t = self.now()
        while self.backward_stack and self.backward_stack[-1].backward_task == task:
            self._pop_backward(t)
