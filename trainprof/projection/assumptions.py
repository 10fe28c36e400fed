"""What a prediction assumed, as records: a kind and its values, with the text rendered from them.

Tests and reports read `values`; people read `text`. Every kind has one template below, so a reader
sees every sentence the projection can say in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# kind -> str.format template over the record's values
TEMPLATES: dict[str, str] = {
    # machines
    "rates_from_source": ("{target} from {source} measured: matmul x {key} {target_figure:g}/{source_figure:g}, memory x "
                          "datasheet {target_gbps:g}/{source_gbps:g} GB/s (the source's measured efficiency carries over)"),
    "datasheet_peak": "{target}: no published MAMF; the datasheet dense peak is used (optimistic)",
    "host_engine_change": ("host across the engine change: the operator calls a decoder layer issues and their host "
                           "time per call are the GPU references' for {target_engine}, the latter at the source "
                           "host's pace against the references for {source_engine} ({pace}); the calls outside "
                           "the layers and the device work as the source's engine had them"),
    "host_bound_source": ("the source's GPU ran kernels {busy_frac:.0%} of the step (operator trace): host-bound; the "
                          "host's part is predicted as host time (the target's host CPU assumed as fast as the source's)"),
    # compute
    "threads_launched": ("compute: each of the {world} rank(s) at {threads} intra-op thread(s), as a run launched "
                         "here gets them ({why}); the source's ranks ran at {source_threads}"),
    "ranks_uneven": ("compute: the source's ranks were busy {fastest_ms:.1f}-{slowest_ms:.1f} ms a step (rank "
                     "{slowest_rank} the slowest, +{spread:.0%}) and the prediction keeps the slowest one's pace, "
                     "which a run on {world} rank(s) need not have (the cores, or the GPUs, ran unevenly)"),
    "parts_probed": ("compute: each decoder layer's measured time plus the change of one bare layer's work "
                     "({layer_source_ms:.2f} -> {layer_target_ms:.2f} ms forward per micro batch), x {target_layers} "
                     "layers for {source_layers}; the rest of the model's measured time plus the change of its bare "
                     "work ({rest_source_ms:.2f} -> {rest_target_ms:.2f} ms); both shapes timed on this machine in one "
                     "call with no decoder layer and with {probe_layers}{neighbours_text}{threads_text}{same_text}; hooks and engine "
                     "work per module call kept as measured; ZeRO-3's parameter copies {copies_ms:+.2f} ms; time outside the "
                     "model as measured"),
    "probe_kept": ("probes: the {what} probe was timed on this machine at {made_utc} UTC, by an earlier projection of "
                   "this run, and read from its {file}"),
    "parts_analytic": ("compute: the shape is not probed here ({why}); decoder layers and the rest of the model scaled by "
                       "their GEMM time at each shape ({rates}) and their memory traffic"),
    "recompute_on": ("recompute: one more forward of every decoder layer inside backward ({layers_forward_ms:.2f} ms per "
                     "micro batch, engine hooks included)"),
    "engine_change": ("engine, task or dtype change: forward x{forward:.2f}, backward x{backward:.2f} (both "
                      "engines, each with its task and dtype, probed at the source's shape in one process, a group "
                      "of one, called alternately)"),
    "engine_change_other_machine": ("engine change on another machine: the decoder layers' operator calls are the target "
                                    "engine's GPU references and the device work is derived from the shapes; the "
                                    "calls outside the layers are counted as the source's engine issued them (probe "
                                    "the change on the source machine with --to this)"),
    "device_rerated": ("compute on {target}: each phase's device work re-rated: GEMMs at the target's rate for their shapes "
                       "({matmul_source}), the rest by the memory bandwidth it reaches ({memory_source} x "
                       "{elementwise}; the source's: {source_elementwise})"),
    "device_analytic": ("compute on {target}: the device work derived from the target's shapes alone (a CPU's "
                        "efficiency says nothing of a GPU's): every GEMM at the target's rate for its shape "
                        "({matmul_source}); the other operators' bytes, as counted on the model's code "
                        "(scripts/count_traffic.py), at the bandwidth ({memory_source}) x {elementwise}"),
    "host_bound_target": ("predicted host-bound on {target}: the host's {calls:,.0f} operator calls ({layers} decoder "
                          "layers' and the rest's) take {host_ms:.1f} ms a step "
                          "against the device's {device_ms:.1f} ms (forward, backward, recompute): the GPU busy {busy:.0%} of "
                          "them, under the {bar:.0%} that marks a measured phase host-bound, waits for the host there and a "
                          "faster GPU does not shorten them"),
    "comm_bound": ("predicted comm-bound: exposed communication is {share:.0%} of the step ({ms:.1f} ms), the "
                   "collectives' time beyond the compute they overlap{held_text}: faster links shorten it and more "
                   "tokens a step hide more of it behind compute; a faster GPU or host does not shorten it"),
    "comm_outlasts_compute": ("comm: the collectives outlast the compute they overlap in {phases} ({ms:.1f} ms of "
                              "collectives against {compute_ms:.1f} ms of compute): those phases take the "
                              "collectives' time"),
    "carried_as_measured": ("{ms:.1f} ms of the step ({share:.0%}) is the CPU source's time outside its phases and its "
                            "data wait, carried to the GPU as measured: whatever the script did there (gradient "
                            "clipping, logging, a scheduler) is not re-rated for the GPU"),
    "host_ceiling": ("host on the source's own GPU kind: a device-bound phase's operator calls took its host at most "
                     "the phase over its calls ({phases} µs a call), below the catalog's reference, so at most that"),
    "host_time": ("host: {ops_per_step:,.0f} operator calls a step in the source's trace (a changed model's decoder "
                  "layers' scaled by its depth) at {us_per_op:.1f} us each ({us_source}); a phase takes "
                  "the longer of its host and device time (the GPU runs asynchronously)"),
    "host_time_per_call": ("host: each operator call at {us_per_op:.1f} us ({us_source}); a phase takes the longer "
                           "of its host and device time (the GPU runs asynchronously)"),
    "gpu_ops_per_layer": ("host: a decoder layer issues {forward:.0f} operator calls a forward and {backward:.0f} a "
                          "backward, as GPU runs of the engine issue them ({source}), not as this CPU run did"),
    "host_stand_in": "host: {why}",
    "gpu_ops_finetune": ("host: those counts are pretraining runs'; a {task} layer's adapters{quantized} issue calls "
                         "they leave out, at a host cost per call no reference run measured: the host time is likely "
                         "low"),
    "host_layers_only": ("host: the decoder layers' operator calls only (the run kept no operator trace, so the "
                         "embedding's, the head's and the loss's calls are not counted): the host time is a lower "
                         "bound (profile.ops=true records them)"),
    "host_unknown": ("host: not modelled ({why}); the prediction is the device time alone and may be optimistic"),
    # optimizer
    "optimizer_probed_step": ("optimizer: the target engine's step() probed in a group of one ({step_ms:.2f} ms over "
                              "{state_elements:,.0f} state elements), with Adam's pass re-priced for {target_elements:,.0f} "
                              "elements per rank at {bytes_per_element} B each over {memory_gbps:.3g} GB/s"),
    "optimizer_probed_pass": ("optimizer: as measured, plus the change of a mixed-precision AdamW pass over the state "
                              "elements per rank ({source_elements:,.0f} at {source_ns:.2f} ns each -> "
                              "{target_elements:,.0f} at {target_ns:.2f} ns), each shape's pass timed on this machine "
                              "over its bare model's parameters"),
    "optimizer_fixed_plus_pass": ("optimizer: {fixed_ms:.2f} ms fixed as measured + Adam's pass over {target_elements:,.0f} "
                                  "state elements per rank at {bytes_per_element} B each over {memory_gbps:.3g} GB/s"),
    "optimizer_scaled": "optimizer: scaled by state elements per rank ({ratio:.3g}x)",
    "optimizer_engine_ratio": "engine change: optimizer step x{ratio:.2f} (both engines' step() probed in a group of one)",
    "optimizer_rerated": ("optimizer on {target}: the source's optimizer kernels moved with the {target_elements:,.0f} "
                          "state elements per rank and the bandwidth ({memory_gbps:.4g} GB/s)"),
    "optimizer_gpu_bytes": ("optimizer on {target}: {target_elements:,.0f} parameters per rank x {bytes_per_param:.1f} B "
                            "({source}) over {memory_gbps:.4g} GB/s"),
    "optimizer_own_gpu": ("optimizer on the source's GPU: its measured {measured_ms:.1f} ms with its kernels ({kernels_ms:.1f} "
                          "ms) moved with the state per rank ({target_elements:,.0f} elements); the host's calls and "
                          "waits around them as measured"),
    "optimizer_host_longer": ("optimizer: the longer of its kernels and the host's {calls:,.0f} calls x {us:.1f} µs "
                              "(a step that does not wait for its kernels)"),
    "optimizer_host_added": ("optimizer: DeepSpeed's step waits for its kernels between its host calls, so "
                             "{calls:,.0f} calls x {us:.1f} µs add to the kernels ({source})"),
    # communication
    "comm_as_measured": "comm: as measured (same world size and link); forward/backward collectives per micro batch",
    "comm_zero_volume": "comm: ZeRO stage {source_stage} -> {target_stage} volume x{ratio:.2f} (ZeRO paper)",
    "comm_retimed": ("comm: each collective keeps the exposed time measured at the source, scaled by its price "
                     "(alpha + bytes*busfactor/busbw over {link}) at the target's ranks over the source's; a "
                     "one-rank source's collectives are priced whole"),
    "comm_one_rank": "comm: one rank: no collectives",
    "comm_gathers_added": ("comm: parameter all-gathers in {phases} added (ZeRO stage {stage}; the one-rank source issued "
                           "none), one call each"),
    "comm_slowest_rank": ("comm: + {wait_ms:.2f} ms waiting for the slowest of {ranks} ranks (measured step spread "
                          "{std_ms:.2f} ms x E[max of {ranks} normals] = {factor:.3f})"),
    "comm_zero_derived": ("comm: ZeRO stage {stage}'s collectives derived from the {mbytes:.3g} MB of trainable parameters "
                          "over {link}: gradient all_reduce {reduce_calls} call(s), {reduce_ms:.2f} ms{overlap_text}"
                          "{gather_text}; the source's small optimizer collectives as measured, {small_ms:.2f} ms"),
    "comm_zero3_derived": ("comm: ZeRO-3's collectives derived from the {mbytes:.4g} MB of parameters over {link}: "
                           "{gathers} parameter all-gather(s) in forward and again in backward ({gather_ms:.2f} ms each "
                           "pass), {scatters} gradient reduce-scatter(s) ({scatter_ms:.2f} ms), {persistent} persistent "
                           "parameter(s) gathered after the step ({after_ms:.2f} ms); prefetched and overlapped with "
                           "the phase's compute: exposed = max(0, comm - compute) per phase"),
    "comm_rows_repriced": ("comm: on the source's machine, each of the source's collective rows keeps its measured "
                           "exposed time, scaled by the target's calls and bytes priced over {link} (alpha + bytes/bw) "
                           "against the source's"),
    "comm_fsdp_derived": ("comm: FSDP2's collectives derived from the {mbytes:.4g} MB of parameters over {link}: "
                          "{units} fully_shard units, each all-gathered before its forward ({gather_ms:.2f} ms a pass)"
                          "{regather_text} and its fp32 gradients reduce-scattered ({scatter_ms:.2f} ms)"),
    "comm_ddp_derived": ("comm: PyTorch DDP's gradient all_reduce derived from the {mbytes:.3g} MB of fp32 gradients: "
                         "{buckets} bucket(s), {hidden_text}; the last ({last_mbytes:.3g} MB), "
                         "launched when the backward ends, blocking: {tail_ms:.2f} ms over {link}"),
    "comm_wait": ("comm: + {wait_ms:.2f} ms a blocking call waited in training: the source's {calls} blocking collectives "
                  "took {measured_ms:.2f} ms against {priced_ms:.2f} ms priced by the same fit"),
    "comm_no_wait": "comm: no in-training wait added ({why})",
    "link_measured": ("link: gloo over {world} local processes, measured on this machine: alpha {alpha_ms:.3f} ms, busbw "
                      "{busbw_gbps:.3g} GB/s (medians of {fits} collective fits)"),
    "link_catalog": ("link: {name}, {gbps:g} GB/s per direction per GPU ({gbps_source}){inter_text}; latency per "
                     "collective from NCCL's ring model: {base_us:g} us + {intra_us:g} us per intra-node step + "
                     "{net_us:g} us per inter-node step ({latency_source}); the datasheet bandwidth is taken as bus "
                     "bandwidth (an upper bound)"),
    "probes_noisy": ("probes: the bare layers' probed time is uncertain by ±{error:.1%} (the standard error of its "
                     "median over the probe's rounds, above {limit:.0%}): this machine was busy while it probed, and the "
                     "row can be off by more than its expected error; project again when the machine is quiet"),
    "probe_slower_than_run": ("probes: a bare decoder layer at the run's own shape took {ratio:.1f}x the run's "
                              "measured {phase} layer, hooks included (above {limit:.1f}x): this machine ran slower "
                              "while it probed than during the run, and the row can be off by more than its expected "
                              "error; project again when the machine is as busy as it was during the run"),
    # the rest
    "unattributed": ("unattributed {ms:.2f} ms (the source's {source_ms:.2f} ms, the median step minus the per-phase "
                     "medians, scaled with the phases); other as measured"),
    "data_wait_dominates": ("data wait kept as measured is {share:.0%} of the predicted step: it would dominate; raise "
                            "data.num_workers"),
    "memory_engine_fixed_part": ("memory: the measured peak's fixed part (libraries, the engine's own buffers) is kept, but "
                                 "it belongs to the source's engine ({engine}); a change of engine moves it by an amount "
                                 "the plan's formulas do not see (docs/projection.md){why}"),
    "memory_engine_probed": ("memory: the measured peak's fixed part moves from the {source_engine} engine's to the "
                             "{target_engine} engine's: each built around the source's model by {world} fresh "
                             "processes, the fullest one's peak RSS minus what the plan counts in it ({source_mib:.0f} and "
                             "{target_mib:.0f} MiB: libraries, the engine's runtime and buffers)"),
    "memory_heap_kept": ("memory: the freed blocks a CPU process's heap keeps (train.cpu_allocator: cache) are in the "
                         "measured peak but not in the plan's formulas, and they grow with the step's largest "
                         "transient tensors (the fp32 logits of a micro batch: {source_logits_mib:.0f} -> "
                         "{target_logits_mib:.0f} MiB): expect a higher peak than this (docs/projection.md, model "
                         "size){why}"),
    "memory_heap_probed": ("memory: the freed blocks a CPU process's heap keeps (train.cpu_allocator: cache) grow with "
                           "the step's largest transient tensors (the fp32 logits of a micro batch: {source_logits_mib:.0f} "
                           "-> {target_logits_mib:.0f} MiB); the source's and the target's recipes, each with {layers} "
                           "decoder layers, were run for 3 steps by {world} fresh processes, and the fullest one's peak "
                           "RSS minus what the plan counts in it ({source_mib:.0f} and {target_mib:.0f} MiB: libraries, the "
                           "engine's runtime and buffers, and the heap's freed blocks) moves the measured peak; the heap "
                           "also grows over a run's steps, which 3 steps do not show (docs/projection.md, model size)"),
    "pipeline_bubble": ("pipeline: stage {stage} sets the pace (the busiest); its measured bubble {bubble_ms:.2f} ms x its "
                        "predicted / measured compute per micro batch ({target_mb_ms:.2f} / {source_mb_ms:.2f} ms): fill "
                        "and drain take (p - 1) micro-batch times whatever the number of micro batches"),
    "pipeline_transfer": ("pipeline: one boundary transfer {ms:.3f} ms over {link} (alpha + bytes/bw); inside the "
                          "bubble, not added to it"),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Assumption:
    """One assumption of a prediction: `kind` names its template in TEMPLATES, `values` fill it."""

    kind: str
    values: dict[str, Any]

    @property
    def text(self) -> str:
        return TEMPLATES[self.kind].format(**self.values)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "values": self.values, "text": self.text}


def assume(kind: str, **values: Any) -> Assumption:
    """An Assumption, its text rendered once here so a template and its values that disagree fail where
    they are made, not in a report."""
    if kind not in TEMPLATES:
        raise KeyError(f"no assumption template '{kind}'")
    made = Assumption(kind=kind, values=values)
    made.text  # noqa: B018  renders, raising KeyError/ValueError on a mismatch
    return made
