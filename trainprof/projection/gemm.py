"""The work of a Llama model at a shape, analytically: its GEMMs (m, n, k per call, per phase) and its
memory traffic, split into the decoder layers and the rest of the model; and a machine's GEMM rate at
a given shape, from a calibration curve over sizes or, without one, the roofline.

Used where a shape cannot be probed (another machine, or a model too large to build here): a part's
time at the target is its time at the source x (its GEMM time at the target's shapes and rates / at
the source's) for the matmul share, and x the ratio of memory traffic over bandwidth for the rest.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from trainprof.shapes import DTYPE_BYTES, LlamaShape

# Bytes HF Llama's non-GEMM operators read and write per micro batch, counted op by op on the model's own
# code (scripts/count_traffic.py: every aten op but GEMMs, attention and views, under a TorchDispatchMode,
# sdpa attention; fits within 2.1%). Per decoder layer: [per token x h, per token x kv, per token x I, per
# weight element], kv = num_kv_heads x head_dim (GQA's keys and values are narrower); the rest of the
# model: [per token x h, per token x V, per V x h]. "amp": fp32 weights under bf16 autocast (the torch
# engine), whose casts are the weight term; "bf16": 16-bit weights (DeepSpeed, FSDP2).
ELEMENTWISE_BYTES = {
    ("bf16", "forward"): (104.31, 20.01, 10.0, 0.04), ("bf16", "backward"): (253.16, 33.0, 18.01, 0.07),
    ("amp", "forward"): (142.55, 36.02, 9.97, 6.08), ("amp", "backward"): (351.39, 59.0, 17.98, 6.11),
}
REST_BYTES = {
    ("bf16", "forward"): (41.39, 17.66, 2.68), ("bf16", "backward"): (98.11, 26.01, 2.0),
    ("amp", "forward"): (40.71, 17.74, 10.53), ("amp", "backward"): (106.12, 26.01, 10.0),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Gemm:
    m: int
    n: int
    k: int
    calls: int = 1
    fused: bool = False  # inside a fused attention kernel: its s x s operand stays on chip

    @property
    def elements_moved(self) -> int:
        """Elements the GEMM reads and writes: its three operands, less the s x s one (the largest) when fused."""
        operands = (self.m * self.k, self.k * self.n, self.m * self.n)
        return sum(operands) - (max(operands) if self.fused else 0)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.calls


def _linear(tokens: int, fan_in: int, fan_out: int, phase: str, trains_weight: bool = True) -> list[Gemm]:
    """A Linear's GEMMs: forward y = x w^T; backward dx = dy w and, when the weight trains, dw = dy^T x."""
    if phase in ("forward", "recompute"):
        return [Gemm(tokens, fan_out, fan_in)]
    out = [Gemm(tokens, fan_in, fan_out)]
    if trains_weight:
        out.append(Gemm(fan_out, fan_in, tokens))
    return out


def linear_dims(shape: LlamaShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each decoder linear."""
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def layer_gemms(shape: LlamaShape, micro_batch: int, seq_len: int, phase: str, *, frozen: bool = False,
                fused_attention: bool = False) -> list[Gemm]:
    """One decoder layer's GEMMs in a phase (forward, backward or recompute) for one micro batch.

    Args:
        frozen: the layer's linear weights do not train (LoRA's base): no weight-gradient GEMMs.
        fused_attention: SDPA or FlashAttention: the scores never reach memory, so the attention GEMMs are
            priced on their q, k, v and output bytes alone (eager attention writes and reads them).
    """
    t = micro_batch * seq_len
    out: list[Gemm] = []
    for fan_in, fan_out in linear_dims(shape).values():
        out += _linear(t, fan_in, fan_out, phase, not frozen)
    # attention: scores q k^T and their product with v, per head (the causal mask's zeros are computed
    # too by eager kernels; flash-style kernels skip about half, which their own rate absorbs)
    heads = micro_batch * shape.num_heads
    d = shape.head_dim
    per = 1 if phase in ("forward", "recompute") else 2
    out += [Gemm(seq_len, seq_len, d, heads * per, fused_attention),
            Gemm(seq_len, d, seq_len, heads * per, fused_attention)]
    return out


def rest_gemms(shape: LlamaShape, micro_batch: int, seq_len: int, phase: str, *, frozen: bool = False) -> list[Gemm]:
    """The rest of the model's GEMMs: the LM head (the embedding is a lookup)."""
    if phase == "recompute":
        return []
    return _linear(micro_batch * seq_len, shape.hidden_size, shape.vocab_size, phase, not frozen)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GemmRate:
    """A machine's GEMM throughput as a function of a GEMM's shape: a measured curve (TFLOP/s at square
    sizes n) interpolated in log-log on the GEMM's geometric-mean size, capped by the roofline of its
    operand bytes over the memory bandwidth; without a curve, the roofline under the best rate."""

    best_tflops: float
    memory_gbps: float
    dtype_bytes: int = 2
    curve: tuple[tuple[int, float], ...] = ()  # (n, TFLOP/s), ascending n
    source: str = ""

    def tflops(self, g: Gemm) -> float:
        size = (g.m * g.n * g.k) ** (1 / 3)
        rate = self.best_tflops if not self.curve else _interpolate(self.curve, size)
        intensity = 2.0 * g.m * g.n * g.k / (self.dtype_bytes * g.elements_moved)
        return min(rate, intensity * self.memory_gbps / 1e3)

    def ms(self, gemms: list[Gemm]) -> float:
        return sum(g.flops / (self.tflops(g) * 1e12) * 1e3 for g in gemms)


def _interpolate(curve: tuple[tuple[int, float], ...], size: float) -> float:
    """TFLOP/s at `size` from (n, TFLOP/s) points: log-log between neighbours, the end values beyond."""
    ns = [n for n, _ in curve]
    if size <= ns[0]:
        return curve[0][1]
    if size >= ns[-1]:
        return curve[-1][1]
    j = bisect.bisect_left(ns, size)
    (n0, r0), (n1, r1) = curve[j - 1], curve[j]
    w = (math.log(size) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


def curve_from_calibration(cal: dict, phase: str | None = None) -> tuple[tuple[int, float], ...]:
    """(n, TFLOP/s) from a calibration.json's GEMM rows: per size the layouts of `phase` (forward: the
    "nt" layout; backward: "nn" and "tn"), else the best layout; ascending n."""
    layouts = {"forward": ("nt",), "recompute": ("nt",), "backward": ("nn", "tn")}.get(phase or "", None)
    by_n: dict[int, list[float]] = {}
    for row in cal.get("matmul", {}).get("gemms") or []:
        if layouts is None or row.get("layout") in (None, *layouts):  # version 1 timed one layout
            by_n.setdefault(int(row["n"]), []).append(float(row["tflops"]))
    if layouts is None:
        return tuple((n, max(v)) for n, v in sorted(by_n.items()))
    # equal FLOPs in each layout of a phase: the harmonic mean is the phase's rate
    return tuple((n, len(v) / sum(1 / x for x in v)) for n, v in sorted(by_n.items()) if all(x > 0 for x in v))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """The work of one micro batch of a recipe's model: its shape and what it runs at."""

    shape: LlamaShape
    micro_batch: int
    seq_len: int
    attention: str
    dtype: str
    frozen: bool = False  # LoRA/QLoRA: the base's weights get no weight-gradient GEMMs
    lora_targets: tuple[str, ...] = ()  # the linears adapted per layer
    lora_r: int = 0
    quantized: bool = False  # QLoRA: 4-bit base linears dequantized for every GEMM
    amp: bool = False  # fp32 weights under 16-bit autocast (plan.fp32_residual), not 16-bit weights

    @classmethod
    def of(cls, recipe) -> "Work":
        from trainprof.models import resolve_shape
        from trainprof.plan import fp32_residual

        task = recipe.task
        tuned = task.kind in ("lora", "qlora")
        return cls(shape=resolve_shape(recipe.model), micro_batch=recipe.train.micro_batch_size,
                   seq_len=recipe.data.seq_len, attention=recipe.model.attention, dtype=recipe.model.dtype,
                   frozen=tuned, lora_targets=tuple(task.lora.target_modules) if tuned else (),
                   lora_r=task.lora.r if tuned else 0, quantized=task.kind == "qlora",
                   amp=fp32_residual(recipe))

    def gemms(self, phase: str) -> list[Gemm]:
        """Every GEMM of the model in a phase (recompute: the decoder layers' forward again), LoRA's
        adapters (x A^T then B^T, rank r) included."""
        layer = layer_gemms(self.shape, self.micro_batch, self.seq_len, phase, frozen=self.frozen,
                            fused_attention=self.attention != "eager")
        dims = linear_dims(self.shape)
        tokens = self.micro_batch * self.seq_len
        for name in self.lora_targets:
            fan_in, fan_out = dims[name]
            layer += _linear(tokens, fan_in, self.lora_r, phase) + _linear(tokens, self.lora_r, fan_out, phase)
        return [dataclasses.replace(g, calls=g.calls * self.shape.num_layers) for g in layer] + \
            rest_gemms(self.shape, self.micro_batch, self.seq_len, phase, frozen=self.frozen)

    def device_bytes(self, phase: str) -> float:
        """Bytes the non-GEMM operators of one micro batch move in a phase, as counted on the model's code
        (ELEMENTWISE_BYTES, REST_BYTES; 16-bit activations, twice that in fp32); recompute is the layers'
        forward again. Eager attention adds its s x s scores written and read; QLoRA reads each 4-bit weight
        (0.5 B) and writes its dequantized copy for every GEMM."""
        regime = "amp" if self.amp else "bf16"
        wide = 1.0 if self.amp else DTYPE_BYTES.get(self.dtype, 2) / 2
        step = "forward" if phase == "recompute" else phase
        t, h, i, v = (self.micro_batch * self.seq_len, self.shape.hidden_size, self.shape.intermediate_size,
                      self.shape.vocab_size)
        a, k, c, w = ELEMENTWISE_BYTES[(regime, step)]
        kv = self.shape.num_kv_heads * self.shape.head_dim
        weights = sum(fan_in * fan_out for fan_in, fan_out in linear_dims(self.shape).values())
        per_layer = wide * (t * (a * h + k * kv + c * i) + w * weights)
        if self.attention == "eager":
            scores = self.micro_batch * self.shape.num_heads * self.seq_len ** 2
            per_layer += wide * 4 * scores * (1 if step == "forward" else 2)
        if self.quantized:
            per_layer += weights * (0.5 + DTYPE_BYTES.get(self.dtype, 2))
        if phase == "recompute":
            return self.shape.num_layers * per_layer
        ra, rc, rw = REST_BYTES[(regime, step)]
        return self.shape.num_layers * per_layer + wide * (t * (ra * h + rc * v) + rw * v * h)
