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
One node pre-hook (`Node.register_prehook`) per producer node and step carries every action on it, in
registration order: a module's output is usually the next module's input, so this halves the Python
calls the engine makes, and an input's close is dropped where the node already closes from a smaller
value (counter values only grow). Leaves have no producer node: they get a tensor hook. The node
pre-hooks of a forward are registered together, in one loop, when the outermost profiled call returns
(`flush`; also when a backward region opens): registered one at a time between the forward's tensor
ops, each registration found its code and data evicted from the caches by the op before it and cost
2-3x as much (scripts/bench_overhead.py --in-situ-only). A forward re-run inside backward
(recomputation) registers at once, since its nodes run right after it. The engine's call on a watched
node only stamps the time and queues (stamp, actions, graph task); the backward stack is settled from
that queue in one loop (`settle`) when the graph task ends, and before anything reads the current
module or appends an event, so the order of the step's events is unchanged. The root module's backward
opening (the memory meter starts its phase there) and operator-traced steps (whose record_function
ranges must open live) are settled at once. This gives nested, properly
ordered backward intervals for calls that run twice, for gradient accumulation (each micro batch has
its own counter values) and under ZeRO-3's own hooks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from trainprof.analysis.records import ModuleInfo
from trainprof.models import logical_numel
from trainprof.profiler.compiled import ORIG_MOD, CompiledModules, profiled_name
from trainprof.profiler.log import B_CLOSE, B_OPEN, F_CLOSE, F_OPEN, R_CLOSE, R_OPEN, StepLog

_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled  # bound once: the hooks call these on every module call
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def _local_numel(p: torch.Tensor) -> int:
    ds_tensor = getattr(p, "ds_tensor", None)  # ZeRO-3: p.data is empty between gathers
    if ds_tensor is not None:
        return int(ds_tensor.numel())
    return p.to_local().numel() if type(p).__name__ == "DTensor" else p.numel()  # FSDP2: this rank's shard


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
            type=type(mod).__name__,
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
        self.counter = 0
        # open forward/recompute calls: [mi, pre, is_recompute, range] (+ [id(module)] for a sentinel)
        self.fstack: list[list[Any]] = []
        self.bstack: list[list[Any]] = []  # open backward calls: [pre, mi, graph task, range]
        self.bstate: dict[int, int] = {}  # pre -> 1 open, 2 closed
        self.callback_tasks: set[int] = set()
        self.pending: list[tuple[Any, list[Any], int]] = []  # engine calls not yet settled: (stamp, actions, task)
        # this step's watched producer nodes -> [step serial, (close from, module or -1, pre), ...]
        self.watched: dict[Any, list[Any]] = {}
        self.unregistered: list[tuple[Any, list[Any]]] = []  # watched nodes whose pre-hook `flush` registers
        self.serial = 0  # a hook left on a node or leaf by an earlier step does nothing
        self.range_names: list[dict[str, str]] | None = None  # set while operator tracing is on
        self.autocast_dtype: torch.dtype | None = None  # the root forward's autocast dtype, if any
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._handles.extend(attach_forward_hooks(self.compiled.hookable(described), self._pre, self._post))
        self._handles.extend(self.compiled.attach(described, self._pre, self._post))
        if recompute_sentinels is None:  # DDP does not forward attributes: ask the module it wraps
            inner = getattr(model, "module", model)
            inner = getattr(inner, ORIG_MOD, inner)  # a torch.compile wrapper: ask the compiled module
            # transformers >= 5.x: is_activation_checkpointing (is_gradient_checkpointing warns as deprecated)
            flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") \
                else "is_gradient_checkpointing"
            recompute_sentinels = bool(getattr(inner, flag, False))
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
        if self.fstack:
            top = self.fstack[-1]
            return top[0], "recompute" if top[2] else "forward"
        if self.bstack:
            return self.bstack[-1][1], "backward"
        return -1, None

    def reset_step(self) -> None:
        self.serial += 1
        self.watched = {}
        self.unregistered = []
        self.pending = []
        self.bstate.clear()
        self.callback_tasks.clear()
        self.fstack.clear()
        self.bstack.clear()

    def end_step(self) -> None:
        """Settle what the engine reported, then let go of this step's autograd nodes (their saved tensors
        are freed by backward already)."""
        if self.pending:
            self.settle()
        self.watched = {}
        self.unregistered = []

    def flush(self) -> None:
        """Register the pre-hooks of the nodes watched since the last flush, in one loop (see the module
        docstring); called when the outermost profiled forward call returns and when a backward region opens."""
        pending = self.unregistered
        if not pending:
            return
        self.unregistered = []
        queue, at_once = self._on_grad, self._on_grad_now
        if self.range_names is not None:  # operator tracing: backward ranges open and close live
            queue = at_once
        for node, actions in pending:
            live = any(action[1] == 0 for action in actions[1:])  # the root's backward begins (memory meter)
            node.register_prehook(functools.partial(at_once if live else queue, actions))

    def settle(self) -> None:
        """Apply the queued engine calls to the backward stack, in the order the engine made them. The
        hooks check `pending` first themselves (a call less on their path)."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        for t, actions, task in pending:
            self._apply(t, actions, task)

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
        log.events.append((R_OPEN if recompute else F_OPEN, mi, t))
        rng = None
        if self.range_names is not None:
            rng = torch.ops.profiler._record_function_enter_new(
                self.range_names[mi]["recompute" if recompute else "forward"], None)
        self.fstack.append([mi, k, recompute, rng])
        if mi == 0 and not recompute:
            self._count_tokens(args, kwargs)
            self.autocast_dtype = _autocast_dtype()
            if self.on_root is not None:
                self.on_root("forward", True)
        if _grad_enabled():
            tensors = _grad_tensors(args)
            if kwargs:
                tensors += _grad_tensors(kwargs)
            if tensors:
                self._watch(tensors, (k, -1, k))
                if recompute:  # a re-run inside backward: its nodes run next
                    self.flush()
        return None

    def _post(self, mi: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        log = self.log
        fstack = self.fstack
        if not log.active or not fstack or fstack[-1][0] != mi or len(fstack[-1]) != 4:
            return None
        if self.pending:
            self.settle()
        if mi == 0 and not fstack[-1][2] and self.on_root is not None:
            self.on_root("forward", False)  # before the stamp: reading the memory meter can take ms (CPU)
        t = self.now()
        _, k, recompute, rng = fstack.pop()
        log.events.append((R_CLOSE if recompute else F_CLOSE, mi, t))
        if rng is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(rng)
        post = self.counter
        self.counter = post + 1
        if output is not None and _grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                self._watch(tensors, (post, mi, k))
        if recompute or not fstack:  # a re-run inside backward (its nodes run next), or the outermost call returned
            self.flush()
        return None

    def _sentinel_pre(self, mi: int, module: torch.nn.Module, args: tuple) -> None:
        """A module below max_depth starts: record only the outermost re-run, under its profiled ancestor."""
        if not self.log.active or _graph_task_id() == -1 or (self.fstack and self.fstack[-1][2]):
            return None
        if self.pending:
            self.settle()
        self.log.events.append((R_OPEN, mi, self.now()))
        self.fstack.append([mi, -1, True, None, id(module)])
        return None

    def _sentinel_post(self, mi: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
        stack = self.fstack
        if not self.log.active or not stack or len(stack[-1]) < 5 or stack[-1][4] != id(module):
            return None
        stack.pop()
        if self.pending:
            self.settle()
        self.log.events.append((R_CLOSE, mi, self.now()))
        return None

    def _count_tokens(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids") if kwargs else None
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if isinstance(ids, torch.Tensor):
            self.log.tokens_seen += ids.numel()
            self.log.seq_len = int(ids.shape[-1]) if ids.dim() else None

    # -- backward ----------------------------------------------------------------------------------

    def _watch(self, tensors: list[torch.Tensor], action: tuple[int, int, int]) -> None:
        """Run `action` = (close from, module to open or -1, its pre) when each tensor's producer node is
        about to run in backward (see the module docstring)."""
        watched = self.watched
        for x in tensors:
            node = x.grad_fn
            if node is None:  # a leaf that requires grad (an input made to require it)
                x.register_hook(functools.partial(self._on_grad_now, [self.serial, action]))
                continue
            actions = watched.get(node)
            if actions is None:
                watched[node] = actions = [self.serial, action]
                self.unregistered.append((node, actions))  # registered by flush() before backward
            elif action[1] >= 0:  # an open; a close is covered by the node's first action
                actions.append(action)

    def _on_grad(self, actions: list[Any], grads: Any) -> None:
        """A watched node is about to run: stamp it and queue its actions for `settle`."""
        if actions[0] != self.serial or not self.log.active:
            return None
        task = _graph_task_id()
        self.pending.append((self.now(), actions, task))
        if task not in self.callback_tasks:
            self._follow(task)
        return None

    def _on_grad_now(self, actions: list[Any], grads: Any) -> None:
        """A watched node whose actions must take effect as it runs: the root's, those of an
        operator-traced step (see `flush`), and a leaf's tensor hook (rare: an input made to require grad)."""
        if actions[0] != self.serial or not self.log.active:
            return None
        if self.pending:
            self.settle()
        task = _graph_task_id()
        if task not in self.callback_tasks:
            self._follow(task)
        self._apply(self.now(), actions, task)
        return None

    def _follow(self, task: int) -> None:
        """Have the engine call `_graph_task_end` when this graph task finishes (only during it can one ask)."""
        self.callback_tasks.add(task)
        _queue_callback(functools.partial(self._graph_task_end, task))

    def _apply(self, t: Any, actions: list[Any], task: int) -> None:
        """Close the backwards a node's first action closes, then open the modules whose output it
        produced (their forward hooks ran in this order)."""
        stack = self.bstack
        k = actions[1][0]
        while stack and stack[-1][0] >= k:
            self._pop_backward(t)
        for i in range(1, len(actions)):
            _, mi, pre = actions[i]
            if mi >= 0 and pre not in self.bstate:
                self._open_backward(mi, pre, t, task)

    def _open_backward(self, mi: int, pre: int, t: Any, task: int) -> None:
        self.bstate[pre] = 1
        stack = self.bstack
        # A module returning its child's output (or the same tensor as a sibling) is opened after the
        # child on that node: it goes below the child, keeping `pre` increasing up the stack.
        i = len(stack)
        while i and stack[i - 1][0] > pre:
            i -= 1
        if self.range_names is not None:
            above = stack[i:]
            for entry in reversed(above):  # ranges must nest: reopen the children inside this one
                torch.ops.profiler._record_function_exit._RecordFunction(entry[3])
            rng = torch.ops.profiler._record_function_enter_new(self.range_names[mi]["backward"], None)
            for entry in above:
                entry[3] = torch.ops.profiler._record_function_enter_new(
                    self.range_names[entry[1]]["backward"], None)
        else:
            rng = None
        stack.insert(i, [pre, mi, task, rng])
        self.log.events.append((B_OPEN, mi, t))
        if mi == 0 and self.on_root is not None:
            self.on_root("backward", True)

    def _pop_backward(self, t: Any) -> None:
        pre, mi, _, rng = self.bstack.pop()
        self.bstate[pre] = 2
        self.log.events.append((B_CLOSE, mi, t))
        if rng is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(rng)
        if mi == 0 and self.on_root is not None:
            self.on_root("backward", False)

    def _graph_task_end(self, task: int) -> None:
        self.callback_tasks.discard(task)
        if not self.log.active:
            return
        if self.pending:
            self.settle()
        t = self.now()
        while self.bstack and self.bstack[-1][2] == task:
            self._pop_backward(t)
