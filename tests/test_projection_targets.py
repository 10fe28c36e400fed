"""`trainprof project` on the DeepSpeed ZeRO-3 quickstart (test_projection's source, and test_engines'
1-rank run), for what no clock decides, so these share the machine with other tests: the memory of an
engine change and of larger logits against real runs, catalog targets with confidence marked in the
table, costs only from given prices, a fit suggestion when memory does not fit, every call kept in its
own folder and listed by the report, --best and the research's tables."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from conftest import NO_CALIBRATION, QUICKSTART_2RANK, QUIET, run_trainprof
from helpers.checks import retry_on_noise
from helpers.projection import MEMORY_TOLERANCE, STEPS, kinds, project


@pytest.fixture
def source(shared_run):
    """The quickstart on 2 ranks, copied into the test's dir: projections write into it."""
    return shared_run(*QUICKSTART_2RANK)


@pytest.mark.slow
def test_an_engine_change_moves_the_memory_by_what_each_engines_process_holds(source, tmp_path):
    """ZeRO-3 -> plain PyTorch DDP on the source's CPU: the plan's formulas move the model states, and each
    engine built around the source's model in a process of its own gives the fixed part the formulas do
    not see (DeepSpeed's process holds more than torch's); the predicted peak lands near a real DDP run's."""
    from trainprof.projection.measured import measured_from_profile

    run_dir, _ = source
    overrides = ["engine.kind=torch", "engine.zero_stage=0"]
    pred = project(str(run_dir), *overrides)["predictions"][0]
    assert "memory_engine_probed" in kinds(pred), kinds(pred).get("memory_engine_fixed_part")
    fixed = kinds(pred)["memory_engine_probed"]
    assert fixed["source_mib"] > fixed["target_mib"] + 20 and fixed["target_mib"] > 100, fixed
    # profiled as the source was (its traced steps' buffers stay in the process), without its calibration
    _, real = run_trainprof(tmp_path / "ddp", 2, STEPS, *overrides, "profile.ops=true", "profile.ops_steps=2", NO_CALIBRATION)
    measured = measured_from_profile(real).peak_memory_bytes
    assert abs(pred["memory_per_rank_bytes"] - measured) / measured < MEMORY_TOLERANCE, (
        pred["memory_per_rank_bytes"], measured, fixed)


@pytest.mark.slow
def test_catalog_targets_costs_fit_and_files(source):
    run_dir, _ = source
    # a node template priced by its GPU's price (a price is per GPU-hour)
    result = project(str(run_dir), "--to", "hgx-h100,rtx4090", "--nodes", "1,2", "--tokens", "1e9",
                     "--price", "h100-sxm=2.0")
    preds = result["predictions"]
    assert [(p["hardware"], p["world_size"]) for p in preds] == [
        ("hgx-h100", 8), ("hgx-h100", 16), ("rtx4090", 8), ("rtx4090", 16)]
    assert (run_dir / "calibration.json").is_file()
    for p in preds:
        assert p["step_ms"] > 0 and 0 < p["mfu"] < 1 and p["fits"] is True
        assert p["time_to_train_s"] == pytest.approx(1e9 / p["tokens_per_s"])
        assert p["scaling_efficiency"] is not None and p["order"] is not None
        # a CPU run projected to a GPU was never validated: marked in the table, never given an error
        assert p["confidence"] == "unvalidated" and p["expected_error_pct"] is None
        assert p["confidence_text"].startswith("unvalidated")
        notes = kinds(p)
        assert "device_analytic" in notes and notes["host_time"]["ops_per_step"] > 100
        assert notes["link_catalog"]["base_us"] == 8.4
    # the tiny model's ZeRO-3 step on a GPU is host-bound (operator calls x a GPU host's time per call), not
    # the sub-millisecond device time, and two nodes cost more than one (the network's latency and bandwidth)
    h100, h100x2 = preds[0], preds[1]
    assert h100["step_ms"] > 10 and h100x2["phases_ms"]["comm_exposed"] > h100["phases_ms"]["comm_exposed"]
    # which the table says beside the row: a faster GPU would not shorten the step
    bound = kinds(h100)["host_bound_target"]
    assert "predicted host-bound" in h100["confidence_text"] and bound["host_ms"] > 10 * bound["device_ms"], bound
    assert h100x2["scaling_efficiency"] < 1.0
    assert h100["cost_per_million_tokens_usd"] == pytest.approx(2.0 * 8 / 3600 / h100["tokens_per_s"] * 1e6)
    assert h100["cost_to_train_usd"] == pytest.approx(2.0 * 8 / 3600 * h100["time_to_train_s"])
    assert preds[2]["cost_per_million_tokens_usd"] is None  # no price given for the 4090: never invented
    assert {p["ordered_by"] for p in preds} == {"tokens_per_s"}  # not every target has a price
    (out,) = list((run_dir / "projections").glob("*hgx-h100_rtx4090"))
    for name in ("projection.json", "projection.md", "projection.html", "projection.png"):
        assert (out / name).stat().st_size > 0, name
    df = pd.read_csv(out / "projection.csv")
    assert len(df) == 4 and df["tokens_per_s"].notna().all() and "confidence_text" in df
    assert df["world_size"].dtype == int and df["nodes"].dtype == int  # beside the shown "16 (2 x 8)"
    doc = json.loads((out / "projection.json").read_text())
    assert re.fullmatch(r"time to train 1e\+09 tokens \((s|min|h|days|years)\)", doc["table"]["columns"][-2])
    assert doc["table"]["columns"][-1] == "total cost"
    assert doc["command"].startswith(f"trainprof project {run_dir} --to hgx-h100,rtx4090")
    # where each price came from, beside the table
    assert "price of hgx-h100: $2 per GPU-hour (given for its GPU h100-sxm; --price on the command line, " in (
        out / "projection.md").read_text()
    assert "nor its GPU" not in preds[2]["reasons"]["cost_per_million_tokens_usd"]  # rtx4090 is the GPU

    # Llama2-7B pretraining on one 24 GB card does not fit; a second call keeps the first call's folder
    big = project(str(run_dir), "model.name=llama2-7b", "data.seq_len=350", "--to", "rtx4090",
                  "--gpus-per-node", "1", "--tokens", "1e9", "--price", "rtx4090=0.69")["predictions"][0]
    assert big["fits"] is False and big["memory_per_rank_bytes"] > 24e9 and big["fit_suggestion"]
    # its step is predicted (what it would take, were it made to fit), but a run that cannot start has no
    # time nor cost to train: null, with the reason
    assert big["tokens_per_s"] and big["time_to_train_s"] is None and big["cost_to_train_usd"] is None
    assert "does not fit" in big["reasons"]["cost_per_million_tokens_usd"], big.get("reasons")
    # where no one change fits, the changes that fit together: 70B at 8 x 4096 tokens on one 24 GB card needs
    # full offload, recomputation and micro batch 1
    huge = project(str(run_dir), "model.name=llama2-70b", "data.seq_len=4096", "train.micro_batch_size=8", "--to",
                   "rtx4090", "--gpus-per-node", "1")["predictions"][0]
    assert huge["fits"] is False and huge.get("fit_suggestion") == [
        "engine.zero_stage=3", "model.recompute=true", "engine.offload=optimizer+params", "train.micro_batch_size=1"
    ], huge.get("fit_suggestion")
    # one GPU is the baseline, not 100% of itself
    assert big["scaling_efficiency"] is None and "one GPU: the baseline" in big["reasons"]["scaling_efficiency"]
    # on 80 GB cards it needs two: eight scale from two, tput(8) x 2 / (8 x tput(2)), the two predicted apart
    eight = project(str(run_dir), "model.name=llama2-7b", "data.seq_len=350", "--to", "a800-80g")["predictions"][0]
    two = project(str(run_dir), "model.name=llama2-7b", "data.seq_len=350", "--to", "a800-80g",
                  "--gpus-per-node", "2")["predictions"][0]
    assert (eight["world_size"], two["world_size"], two["fits"], eight["scaling_base_gpus"]) == (8, 2, True, 2)
    # two have no one-GPU throughput to scale from: null with the reason, never a ratio against what cannot run
    assert two["scaling_efficiency"] is None and "do not fit one GPU of a800-80g" in two["reasons"]["scaling_efficiency"]
    # the same in fp32: the GEMMs at the A800's fp32 rate, the collectives and the plan at 4 bytes an element
    fp32 = project(str(run_dir), "model.name=llama2-7b", "data.seq_len=350", "model.dtype=fp32", "--to",
                   "a800-80g")["predictions"][0]
    assert "dtype" in fp32["change_kinds"] and fp32["step_ms"] > 2 * eight["step_ms"], fp32.get("reasons")
    assert "host-bound" not in fp32["confidence_text"] and "host_bound_target" not in kinds(fp32)  # fp32 GEMMs
    assert fp32["memory_per_rank_bytes"] > eight["memory_per_rank_bytes"]
    assert eight["scaling_efficiency"] == pytest.approx(eight["tokens_per_s"] * 2 / (8 * two["tokens_per_s"]))
    # Llama2-70B's ZeRO-3 at the quickstart's 1,024 tokens a GPU: on one HGX node its host calls bound the step;
    # across 8 nodes its parameter gathers over InfiniBand do, which the row says in place of host-bound
    node, nodes = project(str(run_dir), "model.name=llama2-70b", "--to", "hgx-h100", "--nodes", "1,8")["predictions"]
    assert "predicted host-bound" in node["confidence_text"] and "comm_bound" not in kinds(node)
    share = nodes["phases_ms"]["comm_exposed"] / nodes["step_ms"]
    assert share > 0.5 and kinds(nodes)["comm_bound"]["share"] == pytest.approx(share)
    assert nodes["confidence_text"].endswith(f"; predicted comm-bound ({share:.0%} of the step, its links at datasheet "
                                             "bandwidth: an upper bound)"), nodes["confidence_text"]
    # Llama2-7B's ZeRO-3 on two H100 nodes: a third of the step exposed, yet its forward and backward take their
    # InfiniBand gathers' time, which outlasts their compute: comm-bound, not "host-bound" (which it read)
    (two,) = project(str(run_dir), "model.name=llama2-7b", "--to", "h100-sxm", "--nodes", "2")["predictions"]
    outlast, exposed = kinds(two)["comm_outlasts_compute"], two["phases_ms"]["comm_exposed"] / two["step_ms"]
    assert outlast["phases"] == "forward, backward" and exposed < 0.5 < outlast["ms"] / two["step_ms"], (outlast, two)
    assert (f"predicted comm-bound (its forward, backward set by their collectives, {outlast['ms'] / two['step_ms']:.0%} "
            "of the step") in two["confidence_text"] and "host-bound" not in two["confidence_text"]
    # the research tables' footnotes take marks out of a cell by its "; " (a mark holding one left half of itself)
    assert all("; " not in mark for p in (nodes, two) for mark in p["confidence_marks"]), nodes["confidence_marks"]
    assert big["change_kinds"] == ["seq_len", "model_size", "world_size", "hardware"]
    assert big["step_ms"] > h100["step_ms"]
    # torch.compile is probed on the source's machine only; FSDP2's collectives are derived per unit
    compiled = project(str(run_dir), "model.compile=true", "engine.zero_stage=2", "--to", "h100-sxm")["predictions"][0]
    assert compiled["step_ms"] is None and "torch.compile" in compiled["reasons"]["step_ms"]
    fsdp = project(str(run_dir), "engine.kind=fsdp", "engine.zero_stage=0", "--to", "h100-sxm")["predictions"][0]
    assert fsdp["step_ms"] > 0 and kinds(fsdp)["comm_fsdp_derived"]["units"] == 3
    folders = sorted((run_dir / "projections").glob("*/projection.json"))
    assert len(folders) >= 2 and out / "projection.json" in folders
    html = (run_dir / "report.html").read_text()
    assert all(json.loads(f.read_text())["title"] in html for f in folders)


@pytest.mark.slow
def test_best_settings_and_the_research_tables(source, cli):
    run_dir, _ = source
    best = project(str(run_dir), "model.name=llama2-7b", "data.seq_len=350", "--best", "--to", "a800-80g",
                   "--price", "a800-80g=1.5", "--tokens", "2e12")["best"]
    (a800,) = best
    top, cheap = a800["best_throughput"], a800["best_cost"]
    assert top and cheap and a800["tried"] > 4
    # with --tokens: the fastest setting's time to train them and the cheapest's cost, in the JSON and the kept table
    assert top["time_to_train_s"] == pytest.approx(2e12 / top["tokens_per_s"])
    assert cheap["cost_to_train_usd"] == pytest.approx(cheap["cost_per_million_tokens_usd"] * 2e6)
    (table,) = [pd.read_csv(f) for f in (run_dir / "projections").glob("*best*/best.csv")]
    assert table["time_to_train_s"][0] == pytest.approx(2e12 / top["tokens_per_s"])
    assert table["cost_to_train_usd"][0] == pytest.approx(cheap["cost_per_million_tokens_usd"] * 2e6)
    assert all(r["tokens_per_s"] <= top["tokens_per_s"] for r in a800["runners_up_throughput"])
    assert all(r["cost_per_million_tokens_usd"] >= cheap["cost_per_million_tokens_usd"] for r in a800["runners_up_cost"])
    assert top["memory_per_rank_bytes"] <= 0.9 * 80e9
    # a progress bar over the predictions names the setting under way; in a log (stderr captured here, not a
    # terminal) it is redrawn every 30 s, not once per prediction
    shown = cli("project", run_dir, "model.name=llama2-7b", "data.seq_len=350", "--best", "--to", "a800-80g")
    assert shown.returncode == 0 and "a800-80g x 8: engine.kind=deepspeed engine.zero_stage=" in shown.stderr
    counts = [int(n) for n in re.findall(r"best: (\d+)prediction", shown.stderr)]
    assert counts[-1] >= a800["tried"] + len(a800["refused"]) and counts == sorted(counts), shown.stderr[-500:]
    assert len(counts) < min(5, a800["tried"]), shown.stderr[-500:]
    tables = project(str(run_dir), "--table", "zhang2023", "--to", "a800-80g,rtx4090")
    assert len(tables["table_iii"]) == 3 * 15 and len(tables["table_ix"]) == 3 * 2
    seven_zero3 = next(r for r in tables["table_iii"] if r["model"] == "llama2-7b" and r["method"] == "ZeRO-3")
    assert seven_zero3["a800-80g"]["tokens_per_s"] > seven_zero3["rtx4090"]["tokens_per_s"]
    four_bit = next(r for r in tables["table_iii"] if r["method"] == "ZeRO-2 + 4-bit")
    assert four_bit["a800-80g"]["tokens_per_s"] is None and "optimizer.state_bits" in four_bit["a800-80g"]["reason"]
    # offload runs the optimizer on a host the catalog does not describe: no step, the memory still planned,
    # and never the best setting
    offload = next(r for r in tables["table_iii"] if r["model"] == "llama2-7b" and r["method"] == "ZeRO-3 + offload")
    assert offload["a800-80g"]["tokens_per_s"] is None and "host CPU" in offload["a800-80g"]["reason"]
    assert offload["a800-80g"]["memory_gib"] < seven_zero3["a800-80g"]["memory_gib"]
    assert "offload=none" in top["setting"] and "offload=none" in cheap["setting"]
    ix = next(r for r in tables["table_ix"] if r["model"] == "llama2-70b" and r["method"] == "qlora")
    assert ix["a800-80g"]["memory_gib"] < 80
    # each table's csv is one row per model, method and target, its figures as numbers a frame can group by
    (kept,) = (run_dir / "projections").glob("*zhang2023*")
    iii = pd.read_csv(kept / "table_iii.csv")
    assert len(iii) == 2 * len(tables["table_iii"]) and set(iii["hardware"]) == {"a800-80g", "rtx4090"}
    assert iii["tokens_per_s"].dtype == float and iii["gpus"].dtype == int
    row = iii[(iii["model"] == "llama2-7b") & (iii["method"] == "ZeRO-3") & (iii["hardware"] == "a800-80g")]
    assert row["tokens_per_s"].item() == pytest.approx(seven_zero3["a800-80g"]["tokens_per_s"])
    assert pd.read_csv(kept / "table_iv.csv")["micro_batch"].notna().any()


@pytest.mark.slow
def test_larger_logits_move_the_memory_by_what_the_heap_keeps(shared_run, tmp_path):
    """A vocabulary 32x the source's on the source's CPU: the step's fp32 logits and their gradient grow
    from 0.5 to 16 MiB, and the heap (train.cpu_allocator: cache) keeps freed blocks of them that the
    plan's formulas do not count. Both recipes at the source's depth, each run by a fresh process, give
    that part; the predicted peak lands near a real run's. Without probes the prediction says what it
    leaves out. Untraced 1-rank runs: traced steps make the heap keep more again, which the probe does
    not trace (docs/projection.md). The real run shares the machine, which moves its heap: -0.3% and
    +1.7% on a quiet machine, -8.7% and -1.9% beside a busy core, -10.2% in a CI run; so a miss runs it
    again (up to three runs), as the timing tests do."""
    from trainprof.projection.measured import measured_from_profile

    run_dir, _ = shared_run(1, "engine.zero_stage=3", "engine.offload=none", *QUIET)  # test_engines' ZeRO-3 run
    overrides = ["model.vocab_size=32768"]
    bare = project(str(run_dir), *overrides, "--no-probe")["predictions"][0]
    assert "not probed: --no-probe" in kinds(bare)["memory_heap_kept"]["why"]
    pred = project(str(run_dir), *overrides)["predictions"][0]
    heap = kinds(pred)["memory_heap_probed"]
    assert (heap["layers"], heap["world"]) == (2, 1) and (heap["source_logits_mib"], heap["target_logits_mib"]) == (0.5, 16), heap
    assert heap["target_mib"] > heap["source_mib"] + 16, heap  # a freed block of the logits at least
    assert pred["memory_per_rank_bytes"] - bare["memory_per_rank_bytes"] == pytest.approx(
        (heap["target_mib"] - heap["source_mib"]) * 2**20, abs=1)
    attempt = iter(range(3))

    def check() -> None:  # the real run's heap depends on its scheduling: a loaded machine can grow it past 10%
        _, real = run_trainprof(tmp_path / f"vocab{next(attempt)}", 1, *overrides, *QUIET)
        measured = measured_from_profile(real).peak_memory_bytes
        assert abs(pred["memory_per_rank_bytes"] - measured) / measured < MEMORY_TOLERANCE, (
            pred["memory_per_rank_bytes"], measured, heap)

    retry_on_noise(check)


def test_each_recipe_is_probed_for_its_resident_memory_once(shared_run, monkeypatch):
    """A search predicts many targets from one source, each memory prediction beside a same-machine CPU run
    needing the source's and the target's resident-memory probes (fresh processes, seconds each): the
    source's is probed once for all of them and kept in the run dir for later projections, and a failed
    probe is said in every prediction that needed it, not run again. The probe itself stands in here (it
    counts what it is asked to run); test_larger_logits runs it."""
    from trainprof.hardware import load_catalog
    from trainprof.models import resolve_shape
    from trainprof.projection import probes
    from trainprof.projection.projector import Projector, _plan_bytes
    from trainprof.projection.source import PROBES_FILE, load_source

    run_dir, _ = shared_run(1, "engine.zero_stage=3", "engine.offload=none", *QUIET)  # test_engines' ZeRO-3 run
    asked, failing = [], set()

    def engine_resident(recipe, world, *, steps=3):  # 1 KiB a token of the vocabulary beyond the plan
        vocab = resolve_shape(recipe.model).vocab_size
        asked.append(vocab)
        if vocab in failing:
            raise ValueError("the resident-memory probe failed (stood in)")
        return _plan_bytes(recipe, world, "resident_per_rank") + vocab * 1024

    monkeypatch.setattr(probes, "engine_resident", engine_resident)

    def fixed(*vocabs: int) -> tuple[list, list]:
        source, _ = load_source(run_dir)
        with Projector(source, load_catalog()) as projector:
            targets = [load_source(run_dir, [f"model.vocab_size={v}"])[1] for v in vocabs]
            return [projector.resident_fixed(t) for t in targets], [projector._memory_notes(t) for t in targets]

    source_vocab = resolve_shape(load_source(run_dir)[0].recipe.model).vocab_size
    got, _ = fixed(16384, 32768)
    assert asked == [source_vocab, 16384, 32768]
    assert [(f.source_bytes, f.target_bytes) for f in got] == [(source_vocab * 1024, 16384 * 1024),
                                                               (source_vocab * 1024, 32768 * 1024)]
    got, notes = fixed(32768, 65536)  # a later projection: only the new recipe is probed
    assert asked[3:] == [65536] and got[0].target_bytes == 32768 * 1024
    assert sum("'resident'" in key for key in json.loads((run_dir / PROBES_FILE).read_text())) == 4

    (run_dir / PROBES_FILE).unlink()
    failing.add(source_vocab)
    got, notes = fixed(16384, 32768)
    assert got == [None, None] and asked[4:] == [source_vocab]  # the source's failure ends both, probed once
    for target_notes in notes:
        (note,) = target_notes
        assert note.kind == "memory_heap_kept" and "(stood in)" in note.text, note.text
