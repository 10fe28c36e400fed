"""Report wording that depends on the run's settings, on the recorded 2-rank ZeRO-3 run (tests/data/zero3_2rank)
and on copies of it with one setting changed: the operator table's calls and GFLOPs note, the ZeRO-3
persistence note beside the comm table, and the loss line of a run whose model was built in zero.Init."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainprof.report.sections import calls_cell
from trainprof.report.summary import render_summary

PROFILE = json.loads((Path(__file__).parent / "data" / "zero3_2rank" / "profile.json").read_text())


def _summary(tmp_path: Path, change=None) -> str:
    p = copy.deepcopy(PROFILE)
    if change:
        change(p)
    return render_summary(p, tmp_path)


def _line(md: str, start: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(start))


@pytest.mark.parametrize("calls,cell", [(2.0, 2), (3, 3), (2.5, "2.5"), (1.333, "1.3"), (None, None)])
def test_calls_print_integers_as_integers_and_means_to_one_decimal(calls, cell):
    assert calls_cell(calls) == cell


def test_ops_table_says_how_to_get_gflops_and_prints_whole_calls(tmp_path):
    """The recorded run traced without shapes: the GFLOPs note says to set profile.record_shapes=true, not
    that aten::mm "has none"; a mean of 2.0 calls prints as 2."""
    md = _summary(tmp_path)
    method = _line(md.split("## Operators")[1], "*How measured")
    assert "operator shapes were not recorded" in method and "set profile.record_shapes=true" in method
    assert "n/a where it has none" not in method
    rows = [line for line in md.split("## Operators")[1].splitlines() if line.startswith("| aten::")]
    assert rows and not any(".00 |" in row.split("|")[4] for row in rows)  # the calls column

    def with_shapes(p):
        p["ops_info"]["record_shapes"] = True
        p["ops"][0]["calls"] = 2.5

    md = _summary(tmp_path, with_shapes)
    method = _line(md.split("## Operators")[1], "*How measured")
    assert "record_shapes" not in method and "n/a for other operators" in method
    assert "| 2.5 |" in _line(md.split("## Operators")[1], f"| {PROFILE['ops'][0]['name']} |")


def test_zero3_comm_table_names_the_persistence_threshold(tmp_path):
    """Beside a ZeRO-3 run's comm table: DeepSpeed's default threshold, named as such, or the engine config's
    own value; no such note for ZeRO-2."""
    para = _line(_summary(tmp_path).split("## Communication")[1], "Exposed communication")
    assert "at most 100,000 elements (DeepSpeed's default stage3_param_persistence_threshold" in para

    def own_threshold(p):
        p["engine"]["config"]["zero_optimization"]["stage3_param_persistence_threshold"] = 1000

    para = _line(_summary(tmp_path, own_threshold).split("## Communication")[1], "Exposed communication")
    assert "at most 1,000 elements (stage3_param_persistence_threshold in the engine's config)" in para

    def zero2(p):
        p["recipe"]["engine"]["zero_stage"] = 2
        p["engine"]["config"]["zero_optimization"]["stage"] = 2

    assert "persistence" not in _summary(tmp_path, zero2).split("## Communication")[1].split("##")[0]


def test_zero3_loss_line_says_its_initial_weights_differ(tmp_path):
    """A recipe run at ZeRO-3 built its model in deepspeed.zero.Init: its loss line says its losses are not
    comparable with other engines'; a ZeRO-2 run's loss line is the bare figures."""
    line = _line(_summary(tmp_path), "- **loss first -> last**")
    assert "deepspeed.zero.Init" in line and "compare losses only between ZeRO-3 runs" in line

    def zero2(p):
        p["recipe"]["engine"]["zero_stage"] = 2

    line = _line(_summary(tmp_path, zero2), "- **loss first -> last**")
    assert line.count("->") == 2 and "zero.Init" not in line


def test_the_flops_line_says_why_the_palm_cross_check_is_missing():
    """FLOPs counted on a model with no Hugging Face config (or under wrappers that hide it): the summary's
    FLOPs line says why there is no measured / analytic ratio instead of leaving it out silently."""
    import torch

    from trainprof.profiler.flops import note_missing_analytic
    from trainprof.report.sections import _flops_text

    s = {"flops_per_step": 1e9, "analytic": None, "achieved_tflops": 0.1, "mfu": None, "mfu_reason": "no peak"}
    note_missing_analytic(s, torch.nn.Linear(2, 2), 16)
    assert s["analytic_reason"].startswith("no analytic FLOPs: the model (Linear) has no Hugging Face-style")
    assert _flops_text(s).endswith(f"; {s['analytic_reason']}")
    counted = {"flops_per_step": 1e9, "analytic": {"flops_per_token": 6.0}}
    note_missing_analytic(counted, torch.nn.Linear(2, 2), 16)
    assert "analytic_reason" not in counted  # a cross-check was made: nothing to explain


def test_the_model_part_table_says_its_nested_rows_are_not_meant_to_add_up():
    """Attention, MLP and norms are rows of their own and also inside the decoder layers' row: the shares of a
    2-rank ZeRO-3 run add up past 100%, and the table says why beside it."""
    import json
    from pathlib import Path

    from trainprof.report.sections import category_rows
    from trainprof.report.summary import render_summary

    run = Path(__file__).parent / "data" / "zero3_2rank"
    profile = json.loads((run / "profile.json").read_text())
    rows = {r["label"]: r for r in category_rows(profile)}
    inner = sum(rows[k]["forward_ms"] or 0.0 for k in ("attention", "MLP"))
    assert 0 < inner <= rows["decoder layers"]["forward_ms"]  # nested: inside the layers' time
    assert "attention, MLP and norms are inside the decoder layers" in render_summary(profile, run)


def test_a_busy_machine_is_said_beside_the_figures_and_in_a_diff():
    """env.machine_load: the load average at the profiler's attach and at the profile, against the cores; a run
    on a machine with more runnable threads than cores says so among its answer's facts, and a diff of it warns
    (an offload run read forward 326 ms against 659 ms on a loaded machine: offload does not touch the forward)."""
    import json
    from pathlib import Path

    from trainprof.env import machine_load
    from trainprof.report.diff_report import _hardware_note
    from trainprof.report.rundir import RunData
    from trainprof.report.sections import headline_facts, machine_load_text

    load = machine_load(0.5)
    assert load is not None and load["start"] == 0.5 and load["busy"] == (max(0.5, load["end"]) > load["cores"])
    assert machine_load(None) is None
    run = Path(__file__).parent / "data" / "zero3_2rank"
    profile = json.loads((run / "profile.json").read_text())
    busy = {"start": 5.2, "end": 3.1, "cores": 2, "busy": True, "how": "test"}
    quiet = {**busy, "start": 0.4, "end": 0.9, "busy": False}
    text = machine_load_text(busy)
    assert text.startswith("1-minute load average 5.2 at start, 3.1 at end, on 2 cores; more runnable threads")
    facts = dict(headline_facts(RunData.of_profile({**profile, "env": {**profile["env"], "machine_load": busy}}, run)))
    assert facts["machine load"] == text
    assert "machine load" not in dict(headline_facts(RunData.of_profile(
        {**profile, "env": {**profile["env"], "machine_load": quiet}}, run)))
    note = _hardware_note({**profile["env"], "machine_load": quiet}, {**profile["env"], "machine_load": busy})
    assert note.startswith("B ran on a machine with more runnable threads than cores") and "A: 1-minute" in note
    assert _hardware_note({**profile["env"], "machine_load": quiet}, {**profile["env"], "machine_load": quiet}) is None


def test_the_csv_tables_name_the_model_itself_as_every_table_does(tmp_path):
    """modules.csv wrote the root module's name as "" (pandas reads NaN, so `df[df.name == '<whole model>']` found
    nothing): it is <whole model>, as in report.md, and so is an operator run in the model's own code in ops.csv;
    an operator outside every module keeps an empty cell (no module), and every other name is as recorded."""
    import pandas as pd

    from trainprof.analysis.records import ROOT_LABEL
    from trainprof.report.summary import write_summary

    p = copy.deepcopy(PROFILE)
    assert p["modules"][0]["name"] == ""
    p["ops"][0]["module"] = ""  # an operator in the model's own forward
    write_summary(p, tmp_path)
    modules = pd.read_csv(tmp_path / "modules.csv")
    assert modules["name"].notna().all() and (modules["name"] == ROOT_LABEL).sum() == 1
    assert list(modules["name"]) == [m["name"] or ROOT_LABEL for m in PROFILE["modules"]]
    ops = pd.read_csv(tmp_path / "ops.csv")
    assert ops["module"].iloc[0] == ROOT_LABEL
    assert ops["module"].isna().sum() == sum(o["module"] is None for o in p["ops"]) > 0
    assert list(ops["module"].fillna("-")) == ["-" if o["module"] is None else o["module"] or ROOT_LABEL
                                               for o in p["ops"]]


def _facts(profile: dict, tmp_path: Path) -> str:
    """report.md's Run facts section (no plots)."""
    from trainprof.report.document import render_markdown
    from trainprof.report.rundir import RunData
    from trainprof.report.run_report import build_run_report

    md = render_markdown(build_run_report(RunData.of_profile(profile, tmp_path), plots=False))
    return md.split("## Run facts")[1].split("\n## ")[0]


def test_run_facts_of_a_wrapped_run_come_from_its_workload(tmp_path):
    """A run of trainprof wrap, the callbacks or trainprof.Profiler has no recipe: its Run facts showed "n/a (?,
    attention ?, ...)" and "? measured after ? warm-up" though profile.json's workload and steps hold them. They
    come from the workload (and what it could not read is named) and from the profile's measured steps; a recipe
    run's still come from its recipe."""
    wrapped = copy.deepcopy(PROFILE)
    del wrapped["recipe"]
    wrapped["workload"] = {
        "engine": {"kind": "torch", "zero_stage": 0, "offload": "none"},
        "task": {"kind": "lora", "lora": {"r": 4, "alpha": 8}},
        "model": {"name": "custom", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256,
                  "dtype": "fp32", "attention": "sdpa", "recompute": False, "compile": False},
        "train": {"micro_batch_size": 4, "grad_accum": 2}, "data": {"seq_len": 32},
        "unknown": {"model.dtype": "read on the first forward"}}
    facts = _facts(wrapped, tmp_path)
    lines = {line.split("**")[1]: line.split("**: ", 1)[1] for line in facts.splitlines() if line.startswith("- **")}
    assert lines["model"] == ("custom (hidden 64, layers 2, heads 4, vocab 256; fp32, attention sdpa, recompute "
                              "False, compile False)")
    assert lines["task"] == "lora" and lines["engine"] == "torch, ZeRO stage 0, offload none"
    assert lines["batch"] == "micro batch 4 x grad accum 2 x seq 32 per rank"
    measured = sum(1 for s in PROFILE["steps"] if not s.get("warmup") and s["step"] >= 0)
    # a profile written before the profiler recorded its warm-up count does not say it; one that records it does
    assert "warmup_steps" not in PROFILE["summary"]
    assert lines["steps"].startswith(f"{measured} measured after warm-up (its count is not recorded); "
                                     f"{PROFILE['summary']['steps_used']} used for medians")
    wrapped["summary"]["warmup_steps"] = 3
    counted = {line.split("**")[1]: line.split("**: ", 1)[1] for line in _facts(wrapped, tmp_path).splitlines()
               if line.startswith("- **")}
    assert counted["steps"].startswith(f"{measured} measured after 3 warm-up; ")
    assert lines["settings from"].startswith("its workload")
    assert lines["not read from the loop"] == "model.dtype (read on the first forward)"
    assert not any("?" in lines[k] or "n/a" in lines[k] for k in ("model", "task", "engine", "batch", "steps"))
    assert "recorded workload (no recipe)" in facts and "not available: recipe" not in facts

    recipe = PROFILE["recipe"]
    lines = {line.split("**")[1]: line.split("**: ", 1)[1] for line in _facts(PROFILE, tmp_path).splitlines()
             if line.startswith("- **")}
    assert lines["model"].startswith(f"{recipe['model']['name']} ({recipe['model']['dtype']}, attention ")
    assert lines["steps"].startswith(f"{recipe['train']['steps']} measured after {recipe['train']['warmup_steps']} "
                                     "warm-up; ")
    assert lines["settings from"] == "its recipe" and "not read from the loop" not in lines


def test_a_collective_run_in_some_steps_only_is_named_beside_the_comm_table(tmp_path):
    """comm rows are medians over the steps used, so a one-off collective (DDP's bucket rebuild) reads 0 calls and
    0 ms; its row counts the steps that ran it and the report names it beside the table."""
    from types import SimpleNamespace

    from trainprof.analysis.aggregate import comm_rows
    from trainprof.analysis.diff import used_steps

    row = {"op": "ddp_rebuild_buckets", "phase": "forward", "group_size": 2, "calls": 1, "bytes": 0,
           "total_ms": 300.0, "exposed_ms": 300.0, "peer": None}
    steps = [SimpleNamespace(breakdown=SimpleNamespace(comm=[row] if i == 0 else [])) for i in range(4)]
    (median,) = comm_rows(steps)
    assert (median["calls"], median["total_ms"], median["steps"]) == (0, 0.0, 1)

    n = len(used_steps(PROFILE))
    assert n > 1 and all(c.get("steps") is None for c in PROFILE["comm"])  # recorded before the field
    assert "Not run in every step" not in _summary(tmp_path)

    def one_off(p):
        p["comm"].append({**median, "exposed_ms": 0.0})

    para = _line(_summary(tmp_path, one_off).split("## Communication")[1], "Not run in every step")
    assert para.startswith(f"Not run in every step: ddp_rebuild_buckets (forward) in 1 of the {n} steps used")
