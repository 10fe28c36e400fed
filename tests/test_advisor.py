"""The advisor: each rule fires on a hand-made profile whose figure crosses its threshold, stays silent
just below it, cites the figure that fired it and bounds the gain by that figure; plus one real run dir."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from trainprof.io import read_profile
from trainprof.report.advisor import advise, advice_lines

DATA = Path(__file__).parent / "data"


def quiet_profile() -> dict:
    """A run where nothing should fire: 100 ms steps, compute-bound, micro batch 4, no offload, one rank."""
    return {
        "recipe": {"data": {"num_workers": 0}, "train": {"micro_batch_size": 4, "memory_cap_gb": None},
                   "engine": {"kind": "deepspeed", "zero_stage": 2, "offload": "none"}},
        "engine": {"kind": "deepspeed", "config": {}},
        "env": {"device": "cpu", "world_size": 1},
        "summary": {"step_ms": {"min": 99.0, "median": 100.0, "max": 101.0},
                    "phases_ms": {"data_wait": 1.0, "forward": 30.0, "backward": 55.0, "recompute": 0.0,
                                  "optimizer": 10.0, "comm_exposed": 2.0, "other": 1.0},
                    "unattributed_ms": 1.0, "mfu": None, "peak_memory_bytes": {"forward": 2**30}},
        "straggler": None,
    }


def fired(profile: dict) -> dict[str, dict]:
    return {a["rule"]: a for a in advise(profile)["advice"]}


def test_nothing_fires_on_a_quiet_run_and_says_which_checks_ran():
    result = advise(quiet_profile())
    assert result["advice"] == []
    assert {c["rule"] for c in result["checks"]} == {"oversubscribed", "data_wait", "comm_exposed", "small_batch",
                                                     "host_bound", "optimizer_offload", "straggler", "memory_headroom"}
    (line,) = advice_lines(result)
    assert line.startswith("Nothing triggered.") and "data_wait (phases_ms.data_wait / step_ms = 1.0%" in line


def _with(**changes) -> dict:
    p = copy.deepcopy(quiet_profile())
    for path, value in changes.items():
        *keys, last = path.split("__")
        d = p
        for k in keys:
            d = d[k]
        d[last] = value
    return p


@pytest.mark.parametrize("rule,trigger,below", [
    ("data_wait", {"summary__phases_ms__data_wait": 12.0}, {"summary__phases_ms__data_wait": 2.9}),
    ("comm_exposed", {"summary__phases_ms__comm_exposed": 25.0}, {"summary__phases_ms__comm_exposed": 9.9}),
    ("small_batch", {"recipe__train__micro_batch_size": 1, "summary__unattributed_ms": 4.0,
                     "summary__phases_ms__other": 4.0},
     {"recipe__train__micro_batch_size": 1, "summary__unattributed_ms": 2.0, "summary__phases_ms__other": 2.0}),
    ("optimizer_offload", {"recipe__engine__offload": "optimizer", "summary__phases_ms__optimizer": 35.0},
     {"recipe__engine__offload": "none", "summary__phases_ms__optimizer": 35.0}),
    ("straggler", {"straggler": {"rank": 1, "slower_by_frac": 0.25, "metric": "busy_ms_median"}},
     {"straggler": {"rank": 1, "slower_by_frac": 0.04, "metric": "busy_ms_median"}}),
    ("memory_headroom", {"recipe__train__memory_cap_gb": 4.0}, {"recipe__train__memory_cap_gb": 1.5}),
    ("host_bound", {"gpu_busy": {"step": {"busy_frac": 0.243}}}, {"gpu_busy": {"step": {"busy_frac": 0.81}}}),
])
def test_each_rule_fires_only_on_its_measured_trigger(rule, trigger, below):
    hit = fired(_with(**trigger))
    assert set(hit) == {rule}, set(hit)
    assert rule not in fired(_with(**below))
    a = hit[rule]
    assert a["trigger"]["value"] is not None and a["trigger"]["threshold"] and a["trigger"]["text"]
    assert a["predicted_gain"] is None and a["predicted_gain_reason"].startswith("not projected yet")
    assert isinstance(a["overrides"], dict)


def test_a_run_without_a_recipe_is_advised_from_its_workload():
    """An own loop over FSDP2 (or a wrapped script) has no recipe: its workload's engine decides the advice
    (FSDP2's prefetch, not DeepSpeed's overlap_comm), and the data-loader advice names the script's DataLoader,
    not a recipe key it cannot set."""
    p = _with(summary__phases_ms__comm_exposed=25.0, summary__phases_ms__data_wait=12.0)
    del p["recipe"]
    p["engine"] = {"kind": "torch", "config": None}
    p["workload"] = {"engine": {"kind": "fsdp", "zero_stage": 0, "offload": "none", "reshard_after_forward": True},
                     "unknown": {}}
    hit = fired(p)
    assert "FSDP2, reshard_after_forward True" in hit["comm_exposed"]["trigger"]["text"], hit["comm_exposed"]
    assert "overlap_comm" not in json.dumps(hit["comm_exposed"])
    assert hit["comm_exposed"]["overrides"] == {"engine.reshard_after_forward": False}
    assert "the DataLoader's num_workers" in hit["data_wait"]["action"] and hit["data_wait"]["overrides"] == {}
    assert fired(_with(summary__phases_ms__data_wait=12.0))["data_wait"]["overrides"] == {"data.num_workers": 2}


def test_data_wait_advice_names_what_fills_it_and_never_proposes_what_the_run_does():
    """Under trainprof wrap and the callbacks, data_wait is all the time between optimizer steps, the loop's own
    logging, callbacks and evaluation too (an HF Trainer over in-memory tensors, whose data_wait is its per-step
    logging, is not simply told to add loader workers, nor a script with num_workers=2 "unknown -> 2"). The
    advice says so and is conditional on the loader being what waits; a worker count is proposed only from a
    recorded one and is always more than it; pinned memory only on a GPU, where the run does not pin already. A
    recipe run's data_wait is its loader's fetch alone, and its advice is the recipe key."""
    wrapped = _with(summary__phases_ms__data_wait=12.0)
    del wrapped["recipe"]
    wrapped["engine"] = {"kind": "torch", "config": {"world_size": 1, "model": "LlamaForCausalLM", "optimizer": "SGD"}}
    a = fired(wrapped)["data_wait"]
    assert "unknown" not in a["action"] and "->" not in a["action"]
    assert "the loop's own work" in a["title"] and "(logging, callbacks, evaluation)" in a["trigger"]["text"]
    assert a["action"].startswith("find which first") and "; if the loader waits, give it worker processes " \
        "(the DataLoader's num_workers) and prefetch if it has none" in a["action"]
    assert "does not record its loader's settings" in a["action"] and "log and evaluate less often" in a["action"]
    assert a["overrides"] == {} and a["gain"]["upper_bound_step_frac"] == pytest.approx(0.12)
    hf = copy.deepcopy(wrapped)
    hf["engine"] = {"kind": "hf", "config": {"dataloader_num_workers": 0, "dataloader_pin_memory": False}}
    assert "if the loader waits, raise dataloader_num_workers (0 -> 2) and prefetch" in fired(hf)["data_wait"]["action"]
    hf["engine"]["config"]["dataloader_num_workers"] = 2
    action = fired(hf)["data_wait"]["action"]
    assert "raise dataloader_num_workers (2 -> 4)" in action and "pin_memory" not in action  # a CPU run
    hf["env"]["device_type"] = "cuda"
    assert "(2 -> 4), pin memory (DataLoader pin_memory=True)" in fired(hf)["data_wait"]["action"]
    hf["engine"]["config"]["dataloader_pin_memory"] = True
    assert "pin_memory" not in fired(hf)["data_wait"]["action"]
    own_loop = copy.deepcopy(wrapped)  # trainprof.Profiler: data_wait is wrap_loader's next() alone
    del own_loop["engine"]
    a = fired(own_loop)["data_wait"]
    assert a["action"].startswith("give it worker processes (the DataLoader's num_workers) and prefetch if it has none")
    assert "find which first" not in a["action"] and "->" not in a["action"]
    recipe = fired(_with(summary__phases_ms__data_wait=12.0))["data_wait"]
    assert recipe["action"].startswith("raise data.num_workers (0 -> 2) and prefetch")
    assert recipe["title"] == "Feed the steps faster: more data-loader workers" and "loop" not in recipe["action"]
    assert fired(_with(summary__phases_ms__data_wait=12.0, recipe__data__num_workers=2))["data_wait"]["overrides"] \
        == {"data.num_workers": 4}


def test_gain_bounds_come_from_the_measured_figure():
    a = fired(_with(summary__phases_ms__data_wait=12.0))["data_wait"]
    assert a["trigger"]["value"] == pytest.approx(0.12) and a["gain"]["upper_bound_step_frac"] == pytest.approx(0.12)
    assert "data_wait is 12.0% of the step" in a["trigger"]["text"] and "at most 12.0%" in a["gain"]["text"]
    assert a["overrides"] == {"data.num_workers": 2}
    comm = fired(_with(summary__phases_ms__comm_exposed=30.0, recipe__engine__zero_stage=3))["comm_exposed"]
    assert comm["gain"]["upper_bound_step_frac"] == pytest.approx(0.30) and comm["overrides"] == {"engine.zero_stage": 2}
    assert "this bound leaves out" in comm["gain"]["text"]  # ZeRO-2's gain may exceed the collectives' share
    assert "leaves out" not in fired(_with(summary__phases_ms__comm_exposed=30.0, recipe__engine__zero_stage=2)
                                     )["comm_exposed"]["gain"]["text"]
    st = fired(_with(straggler={"rank": 1, "slower_by_frac": 0.25, "metric": "busy_ms_median"}))["straggler"]
    assert st["gain"]["upper_bound_step_frac"] == pytest.approx(0.25 / 1.25)  # the step shrinks to the others' pace
    mem = fired(_with(recipe__train__memory_cap_gb=4.0, summary__activation_bytes=2**29))["memory_headroom"]
    assert mem["trigger"]["value"] == pytest.approx(0.25)
    # 3 GiB free / (0.5 GiB of activations a micro batch of 4 samples / 4): 24 more samples
    assert mem["overrides"] == {"train.micro_batch_size": 4 + 24}
    assert "128 MiB of activations per extra sample: the measured 512 MiB a micro batch / 4" in mem["action"]
    # the ranking puts the largest bound first
    both = advise(_with(summary__phases_ms__data_wait=5.0, summary__phases_ms__comm_exposed=20.0))["advice"]
    assert [a["rule"] for a in both] == ["comm_exposed", "data_wait"]


def test_projected_gains_attach_to_their_advice_only():
    profile = _with(summary__phases_ms__data_wait=5.0, summary__phases_ms__comm_exposed=20.0,
                    recipe__engine__zero_stage=3)
    rows = [{"rule": "comm_exposed", "overrides": ["engine.zero_stage=2"], "predicted_gain": 0.12,
             "expected_error_pct": 9.0, "expected_error_text": "±9.0% mean, 14.0% max over 4 runs"},
            {"rule": "data_wait", "overrides": ["data.num_workers=2"], "predicted_gain": None,
             "reason": "the step model does not model data.num_workers"}]
    got = {a["rule"]: a for a in advise(profile, rows)["advice"]}
    assert got["comm_exposed"]["predicted_gain"] == 0.12 and "validated step error ±9.0% mean, 14.0% max over 4 runs" in got["comm_exposed"]["predicted_gain_source"]
    assert got["data_wait"]["predicted_gain"] is None and "does not model data.num_workers" in got["data_wait"]["predicted_gain_reason"]
    stale = advise(profile, [{**rows[0], "overrides": ["engine.zero_stage=1"]}])["advice"]
    assert all(a["predicted_gain"] is None for a in stale)  # a projection of other overrides is not this advice's


def test_memory_headroom_needs_a_known_capacity():
    check = {c["rule"]: c for c in advise(quiet_profile())["checks"]}["memory_headroom"]
    assert not check["triggered"] and "capacity unknown" in check["note"]
    gpu = _with(env={"device": "NVIDIA H100", "world_size": 1, "device_memory_bytes": 80 * 2**30})
    assert "memory_headroom" in fired(gpu)
    # a GPU profile written before the device's memory was recorded: the catalog's figure for its device
    older = fired(_with(env={"device": "NVIDIA H200", "device_type": "cuda", "world_size": 1}))["memory_headroom"]
    assert "of 141.00 GiB (catalog memory of the NVIDIA H200 SXM 141GB (NVIDIA H200 datasheet" in older["trigger"]["text"]
    unknown = {c["rule"]: c for c in advise(_with(env={"device": "Some GPU", "device_type": "cuda", "world_size": 1})
                                            )["checks"]}["memory_headroom"]
    assert not unknown["triggered"] and "capacity unknown" in unknown["note"]


def test_advice_on_a_real_run_dir(tmp_path):
    """The recorded 2-rank ZeRO-3 run: exposed communication and the straggler fire, with the run's own
    figures; the report and summary open with them."""
    run = tmp_path / "zero3_2rank"
    shutil.copytree(DATA / "zero3_2rank", run)
    profile = json.loads((run / "profile.json").read_text())
    s = profile["summary"]
    hit = fired(profile)
    assert set(hit) == {"comm_exposed", "straggler"}
    assert hit["comm_exposed"]["trigger"]["value"] == pytest.approx(s["phases_ms"]["comm_exposed"] / s["step_ms"]["median"])
    assert hit["comm_exposed"]["overrides"] == {"engine.zero_stage": 2}  # the run is ZeRO-3
    assert hit["straggler"]["trigger"]["value"] == profile["straggler"]["slower_by_frac"]

    from trainprof.report.run_report import write_reports
    from trainprof.report.summary import write_summary

    write_summary(profile, run)
    written = write_reports(run, scalars=False)
    md, html = written["md"].read_text(), written["html"].read_text()
    assert md.index("## The answer") < md.index("## What to change") < md.index("## Run facts")
    assert "Hide communication behind compute" in md and 'id="advice-table"' in html
    assert f"{100 * s['phases_ms']['comm_exposed'] / s['step_ms']['median']:.1f}% of the step" in md
    assert "comm_exposed" in md.split("## What to change")[0]  # the bottleneck line names the largest phase
    summary = (run / "summary.md").read_text()
    assert summary.index("## What to change") < summary.index("## Where a step goes")


def test_small_batch_reads_the_gpus_idle_share_on_a_gpu_run():
    """On a GPU the idle share is the GPU's (profile.json gpu_busy): the H200 QLoRA run at micro batch 1
    spent 0.3% of its step outside every phase, but its GPU ran kernels 9% of it. Its recomputation is
    already on, so the advice does not ask for it."""
    from conftest import REPO

    profile = read_profile(REPO / "profiles" / "h200-llama7b_qlora")
    a = {x["rule"]: x for x in advise(profile)["advice"]}["small_batch"]
    assert a["trigger"]["figure"] == "gpu_busy.step.idle_frac"
    assert a["trigger"]["value"] == pytest.approx(profile["gpu_busy"]["step"]["idle_frac"]) and a["trigger"]["value"] > 0.9
    assert a["overrides"] == {"train.micro_batch_size": 2} and "recompute" not in a["action"]


def test_checks_whose_condition_is_false_say_they_do_not_apply():
    """Micro batch 4 and offload off: small_batch and optimizer_offload show no figure computed for micro
    batch 1 or for offload, but say why they do not apply."""
    result = advise(quiet_profile())
    checks = {c["rule"]: c for c in result["checks"]}
    assert not checks["small_batch"]["applies"] and checks["small_batch"]["value"] is None
    assert not checks["optimizer_offload"]["applies"] and checks["optimizer_offload"]["value"] is None
    (line,) = advice_lines(result)
    assert "small_batch (does not apply: micro batch 4, not 1)" in line
    assert "optimizer_offload (does not apply: offload is off)" in line
    assert "at micro batch 1 =" not in line and "with offload =" not in line
    on = {c["rule"]: c for c in advise(_with(recipe__train__micro_batch_size=1, recipe__engine__offload="optimizer")
                                       )["checks"]}
    assert on["small_batch"]["applies"] and on["small_batch"]["value"] == pytest.approx(0.02)
    assert on["optimizer_offload"]["applies"] and on["optimizer_offload"]["value"] == pytest.approx(0.10)


def test_oversubscription_comes_first_and_qualifies_comm_and_straggler():
    """A CPU run whose ranks' threads outnumbered its cores: that advice comes first, with no gain bound it
    cannot measure, and the exposed communication and straggler it can cause say so; absent, it is not known."""
    p = _with(summary__phases_ms__comm_exposed=30.0, summary__phases_ms__data_wait=12.0,
              straggler={"rank": 1, "slower_by_frac": 0.25, "metric": "busy_ms_median"})
    assert "oversubscribed" not in fired(p)
    check = {c["rule"]: c for c in advise(p)["checks"]}["oversubscribed"]
    assert check["value"] is None and "not known" in check["note"] and not check["triggered"]
    p["env"]["oversubscribed"] = {"ranks": 4, "threads": 8, "cores": 2}  # as env.cpu_oversubscription records
    advice = advise(p)["advice"]
    assert [a["rule"] for a in advice][0] == "oversubscribed"
    over = advice[0]
    assert over["trigger"]["value"] == pytest.approx(4.0) and over["gain"]["upper_bound_step_frac"] is None
    assert "4 ranks running 8 threads on 2 cores" in over["trigger"]["text"]
    assert "at most 2 ranks" in over["action"] and over["overrides"] == {}
    by_rule = {a["rule"]: a for a in advice}
    for rule in ("comm_exposed", "straggler"):
        assert "the CPU was oversubscribed (4 ranks running 8 threads on 2 cores" in by_rule[rule]["trigger"]["text"]
    assert "oversubscribed" not in by_rule["data_wait"]["trigger"]["text"]
    assert advice_lines(advise(p))[0].startswith("The CPU was oversubscribed")
    p["env"]["oversubscribed"] = {"ranks": 2, "threads": 4, "cores": 2}
    assert "OMP_NUM_THREADS=1 per rank" in fired(p)["oversubscribed"]["action"]
    p["env"]["oversubscribed"] = None  # recorded: not oversubscribed
    assert "oversubscribed" not in fired(p)


def test_a_busy_machine_qualifies_comm_and_straggler_when_the_ranks_did_not_oversubscribe_it():
    """Other work's load (env.machine_load over the cores) can make a rank look like a straggler as well."""
    p = _with(summary__phases_ms__comm_exposed=30.0, straggler={"rank": 0, "slower_by_frac": 0.077,
                                                                 "metric": "busy_ms_median"})
    p["env"]["oversubscribed"] = None
    p["env"]["machine_load"] = {"start": 2.1, "end": 3.47, "cores": 2, "busy": True}
    by_rule = fired(p)
    for rule in ("comm_exposed", "straggler"):
        assert ("the machine was busy while it ran (1-minute load average up to 3.47 on 2 cores, env.machine_load), "
                "which alone can cause this" in by_rule[rule]["trigger"]["text"]), by_rule[rule]
    p["env"]["machine_load"]["busy"] = False
    assert "machine was busy" not in fired(p)["straggler"]["trigger"]["text"]


def test_a_host_bound_gpu_step_is_said_first_and_advised():
    """A GPU step whose kernels ran 24.3% of it (a reference H100 run at micro batch 8) waited for its host the
    rest: the headline's bottleneck is the host, not the largest phase (backward, mostly host time), and the
    advice bounds the gain by the idle share; at micro batch 1 small_batch speaks instead, and a run without a
    kernel trace is not checked."""
    from trainprof.report.advisor import host_bound_text

    host = _with(gpu_busy={"step": {"busy_frac": 0.243}}, recipe__train__micro_batch_size=8)
    advice = fired(host)["host_bound"]
    assert advice["gain"]["upper_bound_step_frac"] == pytest.approx(0.757)
    assert advice["overrides"] == {"train.micro_batch_size": 16} and "model.compile=true" in advice["action"]
    assert host_bound_text(host) == ("the host: the GPU ran kernels 24.3% of the step and waited for its host 75.7% "
                                     "(gpu_busy.step); the largest phase, backward (55.0% of the step), is mostly host time")
    assert host_bound_text(_with(gpu_busy={"step": {"busy_frac": 0.9}})) is None and host_bound_text(quiet_profile()) is None
    for profile, why in ((_with(gpu_busy={"step": {"busy_frac": 0.243}}, recipe__train__micro_batch_size=1),
                          "small_batch covers it"), (quiet_profile(), "no GPU kernel trace")):
        check = {c["rule"]: c for c in advise(profile)["checks"]}["host_bound"]
        assert not check["applies"] and why in check["note"], check
