"""The advisor: "What to change", rules grounded in one run's own figures (profile.json). Each rule
has a measured trigger (the figure, its value and the threshold it crossed), an action, an upper
bound on what the action can gain derived from the measured figure, and the recipe overrides that
would implement it; `trainprof project RUN --advice` projects those overrides and `advise(profile,
predicted)` attaches the predicted gain (null with the reason where the step model cannot).
No trigger, no advice; every check is listed with its figure whether it fired or not, and a check
whose condition this run does not meet (micro batch 1, offload on) says so instead of a figure.

    from trainprof.report.advisor import advise
    result = advise(profile)        # {"advice": [...], "checks": [...]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY
from trainprof.io import dig
from trainprof.report.rundir import run_peak_memory

# Thresholds, as fractions of the median step unless named otherwise. Each is where the upper bound
# of the gain is worth a change of settings, not a property of any hardware.
DATA_WAIT_FRAC = 0.03  # "a few percent" of the step spent waiting for the loader
COMM_EXPOSED_FRAC = 0.10  # communication that compute did not hide
IDLE_FRAC_SMALL_BATCH = 0.05  # idle/unattributed time at micro batch 1 (the research: 5-10% idle at batch 1)
MFU_SMALL_BATCH = 0.30  # achieved / peak FLOP rate below this at micro batch 1 (only where MFU is known)
OPTIMIZER_FRAC_OFFLOAD = 0.20  # optimizer share of the step with ZeRO-Offload
STRAGGLER_FRAC = 0.05  # the slowest rank's median step over the others'
MEMORY_HEADROOM_FRAC = 0.5  # peak memory at most this share of the known capacity
PIPELINE_BUBBLE_FRAC = 0.15  # the pace-setting stage's bubble over its schedule (GPipe: p=2 at m<=5 is above)
STAGE_IMBALANCE_FRAC = 0.10  # the busiest stage over the mean stage, minus 1
NO_PROJECTION = "not projected yet"
OVERSUBSCRIPTION_INFLATES = ("comm_exposed", "straggler")  # ranks waiting on a descheduled peer


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class RunFigures:
    """The figures the rules read, from profile.json, with where each came from."""

    def __init__(self, profile: dict[str, Any]) -> None:
        self.profile = profile
        s = profile.get("summary") or {}
        self.step_ms = dig(s, "step_ms", "median")
        self.phases = s.get("phases_ms") or {}
        self.unattributed_ms = s.get("unattributed_ms")
        self.mfu = s.get("mfu")
        # a run not made from a recipe (own loop, wrap, callbacks) has its workload's recipe keys instead
        self.from_recipe = bool(profile.get("recipe"))
        self.recipe = profile.get("recipe") or {k: v for k, v in (profile.get("workload") or {}).items()
                                                 if k != "unknown"}
        self.engine = profile.get("engine") or {}
        self.config = self.engine.get("config") or {}

    def frac(self, phase: str) -> float | None:
        v = self.phases.get(phase)
        return None if v is None or not self.step_ms else v / self.step_ms

    @property
    def micro_batch(self) -> int | None:
        return (dig(self.recipe, "train", "micro_batch_size") or self.config.get("train_micro_batch_size_per_gpu")
                or self.config.get("per_device_train_batch_size"))

    @property
    def zero_stage(self) -> int | None:
        stage = dig(self.recipe, "engine", "zero_stage")
        return stage if stage is not None else dig(self.config, "zero_optimization", "stage")

    @property
    def offload(self) -> str | None:
        offload = dig(self.recipe, "engine", "offload")
        if offload:
            return offload
        zero = self.config.get("zero_optimization") or {}
        if dig(zero, "offload_optimizer", "device") in ("cpu", "nvme"):
            return "optimizer+params" if dig(zero, "offload_param", "device") in ("cpu", "nvme") else "optimizer"
        return None

    @property
    def num_workers(self) -> int | None:
        n = dig(self.recipe, "data", "num_workers")
        return n if n is not None else self.config.get("dataloader_num_workers")

    def memory_capacity(self) -> tuple[int | None, str]:
        cap = dig(self.recipe, "train", "memory_cap_gb")
        if cap:
            return int(cap * 2**30), f"train.memory_cap_gb={cap}"
        total = dig(self.profile, "env", "device_memory_bytes")
        if total:
            return int(total), f"device memory of {dig(self.profile, 'env', 'device')}"
        from trainprof.hardware import device_memory

        catalog, _ = device_memory(dig(self.profile, "env", "device") or "", dig(self.profile, "env", "device_type") or "")
        if catalog is not None:  # a GPU run whose profile predates env.device_memory_bytes
            return int(catalog["bytes"]), f"catalog memory of the {catalog['accelerator']} ({catalog['source']})"
        return None, "capacity unknown (no GPU memory recorded and no train.memory_cap_gb)"

    def peak_memory(self) -> int | None:
        return run_peak_memory(self.profile.get("summary") or {})


def _advice(rule: str, title: str, figure: str, value: float, threshold: str, trigger_text: str, action: str,
            gain_bound: float | None, gain_text: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {
        "rule": rule, "title": title,
        "trigger": {"figure": figure, "value": value, "threshold": threshold, "text": trigger_text},
        "action": action,
        "gain": {"upper_bound_step_frac": gain_bound, "text": gain_text},
        "overrides": overrides,
        "predicted_gain": None, "predicted_gain_reason": NO_PROJECTION,
    }


# -- rules: each returns (check row, advice or None) --------------------------------------------------

Check = dict[str, Any]
Rule = Callable[[RunFigures], tuple[Check, "dict[str, Any] | None"]]


def _check(rule: str, figure: str, value: Any, threshold: str, triggered: bool, note: str = "",
           applies: bool = True) -> Check:
    """One check's row; `applies` False (with `note` saying why) where the run does not meet the rule's
    condition, so no figure is shown for a condition that is false."""
    return {"rule": rule, "figure": figure, "value": value if applies else None, "threshold": threshold,
            "triggered": triggered and applies, "note": note, "applies": applies}


def _not_applicable(rule: str, figure: str, threshold: str, why: str) -> Check:
    return _check(rule, figure, None, threshold, False, why, applies=False)


def rule_oversubscribed(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    """env.oversubscribed, recorded on CPU runs (env.cpu_oversubscription): {host, ranks, threads, cores} of the
    first host whose ranks' threads together outnumber its cores, or null; absent means not known, not "no"."""
    figure, threshold = "env.oversubscribed: the ranks' threads / cores", "> 100.0%"
    env = f.profile.get("env") or {}
    if "oversubscribed" not in env:
        if env.get("device_type") == "cuda":  # recorded for CPU runs, whose ranks share the host's cores
            return _not_applicable("oversubscribed", figure, threshold, "a GPU run"), None
        return _check("oversubscribed", figure, None, threshold, False, "not recorded in env (not known)"), None
    over = env["oversubscribed"]
    if over is None:
        return _check("oversubscribed", figure, None, threshold, False, "not oversubscribed"), None
    ranks, threads, cores = over["ranks"], over["threads"], over["cores"]
    ratio = threads / cores
    check = _check("oversubscribed", figure, ratio, threshold, True)
    trigger = f"{ranks} ranks running {threads} threads on {cores} cores"
    fix = (f"keep ranks x threads <= {cores}: OMP_NUM_THREADS={max(1, cores // ranks)} per rank, or fewer ranks"
           if ranks <= cores else f"run at most {cores} ranks (one thread each) on this machine")
    return check, _advice(
        "oversubscribed", "The CPU was oversubscribed: fix that before reading communication or stragglers",
        figure, ratio, threshold, trigger,
        f"{fix}, then measure again; threads that take turns on a core stall their rank, which shows as exposed "
        "communication (the other ranks wait in collectives) and as a straggler",
        None, "not bounded by this run: time-slicing slows every phase by an amount it did not measure", {})


@dataclass(slots=True, kw_only=True)
class LoaderFacts:
    """What a run records of its data loader, and what its data_wait phase holds."""

    num_workers: int | None  # None: not recorded
    pin_memory: bool | None  # None: not recorded
    knob: str  # the setting that sets the workers, as the run's user would write it
    # data_wait is all the time between optimizer steps (trainprof wrap, the callbacks: the loader's fetch and the
    # loop's own work there, logging, callbacks, evaluation), not the loader's fetch alone (a recipe's runner,
    # trainprof.Profiler's wrap_loader)
    between_steps: bool

    @classmethod
    def of(cls, f: RunFigures) -> LoaderFacts:
        if f.from_recipe:  # the runner's DataLoader (data.py): data.num_workers, never pinned
            return cls(num_workers=f.num_workers, pin_memory=False, knob="data.num_workers", between_steps=False)
        hf = f.engine.get("kind") == "hf"  # the Trainer's arguments are recorded; other loops' loaders are not
        return cls(num_workers=f.num_workers, pin_memory=f.config.get("dataloader_pin_memory") if hf else None,
                   knob="dataloader_num_workers" if hf else "the DataLoader's num_workers",
                   between_steps=bool(f.engine))


def _loader_action(loader: LoaderFacts, gpu: bool) -> tuple[str, int | None]:
    """What to do to the loader, and the worker count it proposes (None where the run's count is not known):
    never what the run already does."""
    # pinned memory speeds host-to-GPU copies only
    pin = ", pin memory (DataLoader pin_memory=True)" if gpu and loader.pin_memory is not True else ""
    ready = "so batches are ready when a step starts"
    if loader.num_workers is None:
        return (f"give it worker processes ({loader.knob}){pin} and prefetch if it has none, {ready} (this run does "
                "not record its loader's settings)"), None
    target = max(2, 2 * loader.num_workers)
    return f"raise {loader.knob} ({loader.num_workers} -> {target}){pin} and prefetch, {ready}", target


def rule_data_wait(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    frac = f.frac("data_wait")
    check = _check("data_wait", "phases_ms.data_wait / step_ms", frac, f"> {_pct(DATA_WAIT_FRAC)}",
                   frac is not None and frac > DATA_WAIT_FRAC, "" if frac is not None else "no step time measured")
    if not check["triggered"]:
        return check, None
    loader = LoaderFacts.of(f)
    gpu = dig(f.profile, "env", "device_type") == "cuda"
    action, target = _loader_action(loader, gpu)
    trigger = f"data_wait is {_pct(frac)} of the step ({f.phases['data_wait']:.2f} of {f.step_ms:.2f} ms, median)"
    if loader.between_steps:
        title = "Shorten the wait between steps: the data loader, or the loop's own work there"
        trigger += ("; under trainprof wrap and the callbacks it is all the time between optimizer steps: the "
                    "loader's fetch and whatever the loop does there (logging, callbacks, evaluation), not told apart")
        action = ("find which first (time next() on the loader alone, or profile the loop with trainprof.Profiler's "
                  f"wrap_loader); if the loader waits, {action}; if it is the loop's own work, log and evaluate "
                  "less often")
        gain = f"at most {_pct(frac)} less step time, if what fills it is hidden behind compute or removed"
    else:
        title = f"Feed the {'GPU' if gpu else 'steps'} faster: more data-loader workers" + (", pinned memory" if gpu else "")
        gain = f"at most {_pct(frac)} less step time, if loading is hidden entirely behind compute"
    return check, _advice("data_wait", title, "phases_ms.data_wait / step_ms", frac, f"> {_pct(DATA_WAIT_FRAC)}",
                          trigger, action, frac, gain,
                          {"data.num_workers": target} if f.from_recipe and target is not None else {})


def rule_comm_exposed(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    frac = f.frac("comm_exposed")
    check = _check("comm_exposed", "phases_ms.comm_exposed / step_ms", frac, f"> {_pct(COMM_EXPOSED_FRAC)}",
                   frac is not None and frac > COMM_EXPOSED_FRAC)
    if not check["triggered"]:
        return check, None
    stage = f.zero_stage
    overrides: dict[str, Any] = {"deepspeed.zero_optimization.overlap_comm": True}
    action = ("overlap communication with compute (zero_optimization.overlap_comm), use larger buckets "
              "(reduce_bucket_size, allgather_bucket_size) so fewer, bigger collectives run")
    gain = f"at most {_pct(frac)} less step time, if every collective overlaps compute"
    if stage == 3:
        action += "; ZeRO-2 gathers no parameters (ZeRO-3 moves 1.5x ZeRO-2's bytes) if its memory fits"
        overrides = {"engine.zero_stage": 2}
        # the bound is the exposed collectives'; ZeRO-2 also drops ZeRO-3's bookkeeping inside forward and backward
        gain += ("; ZeRO-2 also drops ZeRO-3's parameter fetch and release around every module in forward and "
                 "backward, which this bound leaves out (the predicted gain counts it)")
    sharding = f"ZeRO stage {stage if stage is not None else 'unknown'}"
    if dig(f.recipe, "engine", "kind") == "fsdp":  # FSDP2 has no deepspeed section: its own knobs
        reshard = dig(f.recipe, "engine", "reshard_after_forward")
        sharding = f"FSDP2, reshard_after_forward {reshard}"
        action = ("prefetch the next layer's all-gather (FSDPModule.set_modules_to_forward_prefetch / "
                  "set_modules_to_backward_prefetch) so it overlaps compute")
        overrides = {}
        if reshard:
            action += "; keeping gathered parameters for backward (ZeRO-2-like) saves one all-gather per layer if memory fits"
            overrides = {"engine.reshard_after_forward": False}
    return check, _advice(
        "comm_exposed", "Hide communication behind compute",
        "phases_ms.comm_exposed / step_ms", frac, f"> {_pct(COMM_EXPOSED_FRAC)}",
        f"exposed communication is {_pct(frac)} of the step ({f.phases['comm_exposed']:.2f} ms, median; {sharding})",
        action, frac, gain, overrides)


def rule_small_batch(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    mb = f.micro_batch
    threshold = f"micro batch 1 and (idle > {_pct(IDLE_FRAC_SMALL_BATCH)} or MFU < {_pct(MFU_SMALL_BATCH)})"
    if mb != 1:
        why = "micro batch size not recorded" if mb is None else f"micro batch {mb}, not 1"
        return _not_applicable("small_batch", "idle share at micro batch 1", threshold, why), None
    # on a GPU, the share of the step its kernels left it idle (the research's Figure 5); elsewhere the
    # step's time outside every phase
    gpu_idle = dig(f.profile, "gpu_busy", "step", "idle_frac")
    if gpu_idle is not None:
        idle, figure, what = gpu_idle, "gpu_busy.step.idle_frac", "the GPU's idle share"
    else:
        idle_ms = (f.unattributed_ms or 0.0) + (f.phases.get("other") or 0.0)
        idle = idle_ms / f.step_ms if f.step_ms else None
        figure, what = "(phases_ms.other + unattributed_ms) / step_ms", "idle (other + unattributed)"
    low_mfu = f.mfu is not None and f.mfu < MFU_SMALL_BATCH
    fired = idle is not None and (idle > IDLE_FRAC_SMALL_BATCH or low_mfu)
    check = _check("small_batch", f"{figure} at micro batch 1", idle, threshold, fired)
    if not fired:
        return check, None
    why = f"{what} is {_pct(idle)} of the step at micro batch 1"
    if low_mfu:
        why += f"; MFU {_pct(f.mfu)}"
    bound = idle if idle > IDLE_FRAC_SMALL_BATCH else None
    gain = (f"at most {_pct(idle)} less time per sample from the idle share; a larger batch also raises the "
            "FLOP rate of each kernel, which this run cannot bound" if bound is not None else
            f"MFU {_pct(f.mfu)}: at most {1 / f.mfu:.1f}x the FLOP rate at full utilization (an upper bound)")
    recompute_on = bool(dig(f.recipe, "model", "recompute"))
    return check, _advice(
        "small_batch", "Use a larger micro batch" + ("" if recompute_on else " (activation recomputation makes room)"),
        figure, idle, threshold, why,
        "raise train.micro_batch_size to 2 or more" + ("" if recompute_on else
                                                       "; turn on model.recompute if memory does not allow it"),
        bound, gain, {"train.micro_batch_size": 2} if recompute_on else {"train.micro_batch_size": 2,
                                                                          "model.recompute": True})


def rule_host_bound(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    """A GPU step whose kernels kept the GPU busy less than HOST_BOUND_BUSY of it (gpu_busy.step, the bar
    `trainprof project` calls a source host-bound by): the host's launches set the pace."""
    figure = "gpu_busy.step.busy_frac (the traced step's kernels / the median step)"
    threshold = f"< {_pct(HOST_BOUND_BUSY)}"
    busy = dig(f.profile, "gpu_busy", "step", "busy_frac")
    if busy is None:
        why = f.profile.get("gpu_busy_reason") or "no GPU kernel trace (a CPU run, or profile.ops off)"
        return _not_applicable("host_bound", figure, threshold, why), None
    mb = f.micro_batch
    if mb == 1:
        return _not_applicable("host_bound", figure, threshold, "micro batch 1: small_batch covers it"), None
    fired = busy < HOST_BOUND_BUSY
    check = _check("host_bound", figure, busy, threshold, fired)
    if not fired:
        return check, None
    idle = 1 - busy
    compiled = bool(dig(f.recipe, "model", "compile"))
    action = (f"give each launch more work: raise train.micro_batch_size{f' from {mb}' if mb else ''} (the memory "
              "headroom check says how far)" + ("" if compiled else "; model.compile=true fuses kernels into fewer "
              "launches") + "; a faster host CPU shortens this step, a faster GPU only its kernels' share")
    return check, _advice(
        "host_bound", "The GPU waits for its host: fewer, larger launches", figure, busy, threshold,
        f"the GPU ran kernels {_pct(busy)} of the step and waited for its host {_pct(idle)}", action,
        idle, f"at most {_pct(idle)} less step time at this batch, if the host kept the GPU busy (its kernels' time "
              "is the floor)", {"train.micro_batch_size": 2 * mb} if mb else {})


def host_bound_text(profile: dict[str, Any]) -> str | None:
    """The headline's bottleneck for a GPU step its host paces (the host_bound rule's figure), None otherwise."""
    busy = dig(profile, "gpu_busy", "step", "busy_frac")
    if busy is None or busy >= HOST_BOUND_BUSY:
        return None
    neck = bottleneck(profile)
    largest = f"; the largest phase, {neck[0]} ({_pct(neck[1])} of the step), is mostly host time" if neck else ""
    return (f"the host: the GPU ran kernels {_pct(busy)} of the step and waited for its host {_pct(1 - busy)} "
            f"(gpu_busy.step){largest}")


def rule_optimizer_offload(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    frac = f.frac("optimizer")
    offload = f.offload
    figure, threshold = "phases_ms.optimizer / step_ms with offload", f"offload on and > {_pct(OPTIMIZER_FRAC_OFFLOAD)}"
    if not offload or offload == "none":
        return _not_applicable("optimizer_offload", figure, threshold, "offload is off"), None
    fired = frac is not None and frac > OPTIMIZER_FRAC_OFFLOAD
    check = _check("optimizer_offload", figure, frac, threshold, fired)
    if not fired:
        return check, None
    return check, _advice(
        "optimizer_offload", "The offloaded optimizer step is a large share: bring it back or speed it up",
        "phases_ms.optimizer / step_ms", frac, f"offload on and > {_pct(OPTIMIZER_FRAC_OFFLOAD)}",
        f"optimizer is {_pct(frac)} of the step ({f.phases['optimizer']:.2f} ms) with offload={offload}",
        "turn offload off where GPU memory allows (engine.offload=none), else give DeepSpeed's CPU Adam more "
        "CPU cores per rank and pinned memory",
        frac, f"at most {_pct(frac)} less step time, if the optimizer step took no time", {"engine.offload": "none"})


def rule_straggler(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    st = f.profile.get("straggler")
    slower = st.get("slower_by_frac") if st else None
    fired = slower is not None and slower > STRAGGLER_FRAC
    check = _check("straggler", "straggler.slower_by_frac", slower, f"> {_pct(STRAGGLER_FRAC)}", fired,
                   "" if st else "no straggler recorded (one rank, or ranks within the merge's tolerance)")
    if not fired:
        return check, None
    bound = slower / (1 + slower)  # the others wait for it: the step shrinks to the others' pace at best
    return check, _advice(
        "straggler", f"Rank {st['rank']} is a straggler",
        "straggler.slower_by_frac", slower, f"> {_pct(STRAGGLER_FRAC)}",
        f"rank {st['rank']} is {_pct(slower)} slower than the others ({st.get('metric', 'median step')})",
        f"check rank {st['rank']}'s host and device (clocks, thermal throttling, other processes, its data shard)",
        bound, f"at most {_pct(bound)} less step time, if it ran at the other ranks' pace", {})


def rule_memory_headroom(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    capacity, source = f.memory_capacity()
    peak = f.peak_memory()
    frac = peak / capacity if (capacity and peak) else None
    fired = frac is not None and frac < MEMORY_HEADROOM_FRAC and f.micro_batch is not None
    note = "" if capacity else source
    check = _check("memory_headroom", "peak memory / capacity", frac, f"< {_pct(MEMORY_HEADROOM_FRAC)}", fired, note)
    if not fired:
        return check, None
    mb = f.micro_batch
    act = dig(f.profile, "summary", "activation_bytes")
    if act:  # activations grow with the micro batch's samples; the rest (model states) does not
        per_sample = act / mb
        fits = max(mb, int(mb + (capacity - peak) // per_sample))
        how = (f"{fits} (peak + {per_sample / 2**20:,.0f} MiB of activations per extra sample: the measured "
               f"{act / 2**20:,.0f} MiB a micro batch / {mb}; a step's temporaries grow too, so take maxbatch's figure)")
    else:
        fits = 2 * mb
        how = f"{fits} (doubling; activation bytes not measured)"
    return check, _advice(
        "memory_headroom", "Memory headroom allows a larger micro batch",
        "peak memory / capacity", frac, f"< {_pct(MEMORY_HEADROOM_FRAC)}",
        f"peak memory {peak / 2**30:.2f} GiB is {_pct(frac)} of {capacity / 2**30:.2f} GiB ({source})",
        f"raise train.micro_batch_size from {mb} toward {how}; check with `trainprof maxbatch`",
        None, "throughput gain not bounded by this run (it needs a run at the larger batch); memory allows it",
        {"train.micro_batch_size": fits})


def rule_pipeline_bubble(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    pl = f.profile.get("pipeline") or {}
    frac = pl.get("bubble_frac_measured")
    check = _check("pipeline_bubble", "pipeline.bubble_frac_measured (the pace-setting stage)", frac,
                   f"> {_pct(PIPELINE_BUBBLE_FRAC)}", frac is not None and frac > PIPELINE_BUBBLE_FRAC)
    if not check["triggered"]:
        return check, None
    m, p, mb = pl["micro_batches"], pl["num_stages"], f.micro_batch
    if mb and mb > 1:  # same samples per step, in twice as many, smaller micro batches
        overrides: dict[str, Any] = {"train.micro_batch_size": mb // 2, "train.grad_accum": 2 * m}
        how = f"split each micro batch in two (train.micro_batch_size {mb} -> {mb // 2}, train.grad_accum {m} -> {2 * m})"
    else:
        overrides = {"train.grad_accum": 2 * m}
        how = f"run more micro batches per step (train.grad_accum {m} -> {2 * m}; a larger batch per step)"
    return check, _advice(
        "pipeline_bubble", "Shrink the pipeline bubble with more micro batches",
        "pipeline.bubble_frac_measured", frac, f"> {_pct(PIPELINE_BUBBLE_FRAC)}",
        f"stage {pl.get('bubble_frac_measured_stage')} (sets the pace) waits {_pct(frac)} of its schedule for its "
        f"neighbours (analytic GPipe (p-1)/(m+p-1) = {_pct(pl['bubble_frac_analytic'])} at p={p}, m={m})",
        f"{how}: fill and drain stay (p-1) micro-batch times while the work grows with m",
        frac, f"at most {_pct(frac)} less step time, if the bubble vanished", overrides)


def rule_stage_imbalance(f: RunFigures) -> tuple[Check, dict[str, Any] | None]:
    bal = (f.profile.get("pipeline") or {}).get("balance") or {}
    frac = bal.get("imbalance")
    check = _check("stage_imbalance", "pipeline.balance.imbalance (busiest stage / mean - 1)", frac,
                   f"> {_pct(STAGE_IMBALANCE_FRAC)}", frac is not None and frac > STAGE_IMBALANCE_FRAC)
    if not check["triggered"]:
        return check, None
    s, busy = bal.get("suggestion"), bal["busy_ms"]
    overrides: dict[str, Any] = {}
    gain = None
    if s:
        counts = [sum(1 for m in f.profile.get("modules") or [] if m.get("stage") == st and m["name"].count(".") == 2
                      and m["name"].startswith("model.layers.")) for st in range(len(busy))]
        if all(counts):
            counts[s["from_stage"]] -= s["layers"]
            counts[s["to_stage"]] += s["layers"]
            overrides = {"engine.pipeline_layers": "[" + ",".join(map(str, counts)) + "]"}
        gain = (max(busy) - s["slowest_ms_after"]) / f.step_ms if f.step_ms else None
    action = s["text"] if s else (bal.get("suggestion_none") or "rebalance the stages")
    return check, _advice(
        "stage_imbalance", f"Rebalance the pipeline: stage {bal['slowest_stage']} sets the pace",
        "pipeline.balance.imbalance", frac, f"> {_pct(STAGE_IMBALANCE_FRAC)}",
        f"the busiest stage works {_pct(frac)} more than the mean stage (busy ms per stage: "
        f"{', '.join(f'{b:.1f}' for b in busy)})", action, gain,
        f"at most {_pct(gain)} less step time, from the measured layer times" if gain is not None else
        "not bounded: no whole-layer move lowers the busiest stage", overrides)


RULES: tuple[Rule, ...] = (rule_oversubscribed, rule_data_wait, rule_comm_exposed, rule_small_batch, rule_host_bound,
                           rule_optimizer_offload, rule_straggler, rule_memory_headroom)
PIPELINE_RULES: tuple[Rule, ...] = (rule_pipeline_bubble, rule_stage_imbalance)  # pipeline runs only


def advise(profile: dict[str, Any], predicted: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run every rule on a merged profile.

    Args:
        profile: the content of profile.json.
        predicted: `trainprof project RUN --advice` rows (projection.json "advice"): each advice whose
            rule and overrides match gets predicted_gain (a fraction of tokens/s) and its source.
    Returns:
        {"advice": triggered advice, largest gain bound first, "checks": every rule's figure and outcome}.
    """
    figures = RunFigures(profile)
    checks, advice = [], []
    for rule in RULES + (PIPELINE_RULES if (profile.get("pipeline") or {}).get("stages") else ()):
        check, item = rule(figures)
        checks.append(check)
        if item is not None:
            advice.append(item)
    over = next((a for a in advice if a["rule"] == "oversubscribed"), None)
    contention = _contention_text(over, (profile.get("env") or {}).get("machine_load"))
    for item in advice:
        _attach_prediction(item, predicted)
        if contention and item["rule"] in OVERSUBSCRIPTION_INFLATES:
            item["trigger"]["text"] += f"; {contention}, which alone can cause this: fix that first"
    # oversubscription first: it can cause the communication and straggler figures below it
    advice.sort(key=lambda a: (a["rule"] != "oversubscribed", -(a["gain"]["upper_bound_step_frac"] or 0.0)))
    return {"advice": advice, "checks": checks}


def _contention_text(over: dict[str, Any] | None, load: dict[str, Any] | None) -> str | None:
    """Why ranks may have waited on each other for want of a CPU: this run's own ranks oversubscribed it, else
    the machine's load average exceeded its cores while the run ran (other work, env.machine_load)."""
    if over is not None:
        return f"the CPU was oversubscribed ({over['trigger']['text']})"
    if load and load.get("busy"):
        return (f"the machine was busy while it ran (1-minute load average up to {max(load['start'], load['end']):.2f} "
                f"on {load['cores']} cores, env.machine_load)")
    return None


def _attach_prediction(item: dict[str, Any], predicted: list[dict[str, Any]] | None) -> None:
    if predicted is None:
        item["predicted_gain_reason"] = NO_PROJECTION + ": run `trainprof project RUN_DIR --advice`"
        return
    wanted = sorted(override_args(item["overrides"]))
    row = next((r for r in predicted if r["rule"] == item["rule"] and sorted(r["overrides"]) == wanted), None)
    if row is None:
        item["predicted_gain_reason"] = NO_PROJECTION + " for these overrides (projected before this advice changed)"
    elif row["predicted_gain"] is None:
        item["predicted_gain_reason"] = row.get("reason") or NO_PROJECTION
    else:
        err = row.get("expected_error_text")
        item["predicted_gain"] = row["predicted_gain"]
        item["predicted_gain_reason"] = None
        item["predicted_gain_source"] = ("trainprof project --advice: predicted tokens/s over the same-settings "
                                         "prediction" + (f", validated step error {err}" if err is not None
                                                         else f"; {row.get('expected_error_source') or 'error not validated'}"))


def bottleneck(profile: dict[str, Any]) -> tuple[str, float] | None:
    """The phase with the largest median share of the step, and that share."""
    s = profile.get("summary") or {}
    step, phases = dig(s, "step_ms", "median"), s.get("phases_ms") or {}
    if not step or not phases:
        return None
    name = max(phases, key=lambda k: phases[k] or 0.0)
    return name, (phases[name] or 0.0) / step


def checks_text(checks: list[Check]) -> str:
    """One line listing the checks that ran (for "nothing triggered"); a check whose condition the run
    does not meet says why it does not apply, with no figure."""
    parts = []
    for c in checks:
        if not c.get("applies", True):
            parts.append(f"{c['rule']} (does not apply: {c['note']})")
            continue
        value = "n/a" if c["value"] is None else (_pct(c["value"]) if isinstance(c["value"], float) else str(c["value"]))
        why = f": {c['note']}" if c["value"] is None and c.get("note") else ""
        parts.append(f"{c['rule']} ({c['figure']} = {value}{why}, fires at {c['threshold']})")
    return "; ".join(parts)


def advice_lines(result: dict[str, Any]) -> list[str]:
    """"What to change" as one line per advice (summary.md's bullets, the terminal summary), or the
    checks that ran when nothing triggered."""
    if not result["advice"]:
        return [f"Nothing triggered. Checks: {checks_text(result['checks'])}."]
    lines = []
    for a in result["advice"]:
        lines.append(f"{a['title']}: {a['trigger']['text']} (fires at {a['trigger']['threshold']}). "
                     f"{a['action'][0].upper() + a['action'][1:]}. Gain: {a['gain']['text']}."
                     + (f" Overrides: `{overrides_text(a['overrides'])}`." if a["overrides"] else ""))
    return lines


def override_args(overrides: dict[str, Any]) -> list[str]:
    """Overrides as the `key=value` arguments `trainprof run` takes."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


def overrides_text(overrides: dict[str, Any]) -> str:
    return " ".join(override_args(overrides))
