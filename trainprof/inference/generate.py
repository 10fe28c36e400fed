"""One timed request batch through HF `generate`: static KV cache, greedy, a fixed number of new tokens,
and a timestamp per generated token; plus the serving metrics computed from those stamps.

Token clock: a `StoppingCriteria` that never stops. `generate` calls it once per decoding step, right
after the step's token is appended to the sequences, so its n stamps are the moments the n output
tokens exist. On CUDA it synchronizes first (the token must be computed, not just queued); on CPU
every op runs synchronously on the calling thread and the host clock is the compute time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

TIMER_DESCRIPTION = {
    "cpu": "host monotonic clock (time.perf_counter_ns); one stamp per generated token from a StoppingCriteria "
           "that generate calls right after appending each token (CPU ops run synchronously)",
    "cuda": "host monotonic clock (time.perf_counter_ns) after torch.cuda.synchronize(); one stamp per generated "
            "token from a StoppingCriteria that generate calls right after appending each token",
}

# vLLM's benchmark_serving metric definitions (vllm/benchmarks/serve.py calculate_metrics; formerly
# benchmarks/benchmark_serving.py): tpot = (latency - ttft) / (output_len - 1), itls pooled over requests
METRICS_METHOD = (
    "Metric definitions follow vLLM's benchmark_serving (calculate_metrics in vllm/benchmarks/serve.py, formerly "
    "benchmarks/benchmark_serving.py; docs.vllm.ai 'Benchmark CLI'): "
    "TTFT = first output token stamp - request start; E2EL = request end (generate returned) - request start; "
    "TPOT = (E2EL - TTFT) / (output tokens - 1) per request; ITL = gaps between consecutive output token stamps "
    "(all gaps of all requests pooled); p50/p90/p99 with numpy.percentile (linear), plus the mean. Requests of a batch start "
    "together (static batching, one generate call) so they share their stamps. output_tokens_per_s = output "
    "tokens of all measured requests / the measured calls' summed E2EL (vLLM divides by the benchmark duration; "
    "calls here run back to back, so the two differ by the loop's gaps only); requests_per_s likewise."
)


class TokenClock(StoppingCriteria):
    """Records a stamp (ns) each time generate has appended a token; never stops generation."""

    def __init__(self, cuda: bool, on_token: Callable[[int], None] | None = None) -> None:
        self.cuda = cuda
        self.stamps: list[int] = []
        self.on_token = on_token  # called with the token index (0 = first) after stamping

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter_ns())
        if self.on_token is not None:
            self.on_token(len(self.stamps) - 1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class RequestTiming:
    """One generate call: stamps in ms after its start."""

    batch_size: int
    prompt_len: int
    token_ms: list[float]  # when each output token existed
    end_ms: float  # when generate returned
    cache_bytes: int  # bytes of the static cache tensors generate allocated

    @property
    def output_tokens(self) -> int:
        return len(self.token_ms)


def static_cache_bytes(cache: Any) -> int:
    """Bytes of the key/value tensors a transformers cache allocated (StaticCache: all layers, full length)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def make_prompt(batch_size: int, prompt_len: int, vocab_size: int, seed: int, device: torch.device) -> torch.Tensor:
    """Synthetic prompt token ids (no tokenizer or data needed: the cost depends on the length only)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (batch_size, prompt_len), generator=gen).to(device)


def run_request(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *,
                on_token: Callable[[int], None] | None = None) -> RequestTiming:
    """Run one generate call and time it.

    Args:
        model: a causal LM in eval mode with use_cache on.
        input_ids: (batch, prompt_len) prompt tokens; no padding.
        new_tokens: output tokens per request (min_new_tokens = max_new_tokens; eos disabled).
        on_token: called after each token is stamped (the breakdown switches prefill to decode there).
    Returns:
        the token stamps, the end stamp and the KV-cache bytes.
    """
    cuda = input_ids.device.type == "cuda"
    clock = TokenClock(cuda, on_token)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter_ns()
    # no_grad (generate's own default), not inference_mode: under inference_mode composite ops such as
    # aten::linear reach a TorchDispatchMode undecomposed and the FLOP counter would miss them
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
            cache_implementation="static", eos_token_id=None, pad_token_id=0,
            # eager: the module hooks must fire (HF would torch.compile the forward for a static cache on GPU)
            disable_compile=True, stopping_criteria=StoppingCriteriaList([clock]), return_dict_in_generate=True)
    if cuda:
        torch.cuda.synchronize()
    end = time.perf_counter_ns()
    produced = out.sequences.shape[1] - input_ids.shape[1]
    if produced != new_tokens or len(clock.stamps) != new_tokens:
        raise RuntimeError(f"generate produced {produced} tokens with {len(clock.stamps)} stamps, "
                           f"expected {new_tokens}")
    return RequestTiming(batch_size=int(input_ids.shape[0]), prompt_len=int(input_ids.shape[1]),
                         token_ms=[(s - start) * 1e-6 for s in clock.stamps], end_ms=(end - start) * 1e-6,
                         cache_bytes=static_cache_bytes(_cache(out)))


def _cache(out: Any) -> Any:
    """generate()'s KV cache: `cache` since transformers 5 (`past_key_values` warns there), else the old name."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


def percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {**{f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}, "mean": float(arr.mean())}


def serving_metrics(timings: list[RequestTiming]) -> dict[str, Any]:
    """vLLM's metrics over measured generate calls of one batch size (see METRICS_METHOD).

    Every request of a call has the call's stamps, so per-request lists repeat each call's value
    batch_size times; percentiles are then the same as over calls, weighted by requests.
    """
    ttft, tpot, e2el, itl = [], [], [], []
    tokens = requests = 0
    wall = 0.0
    for t in timings:
        n = t.output_tokens
        first, e2e = t.token_ms[0], t.end_ms
        per_token = (e2e - first) / (n - 1) if n > 1 else None
        gaps = list(np.diff(t.token_ms))
        for _ in range(t.batch_size):
            ttft.append(first)
            e2el.append(e2e)
            if per_token is not None:
                tpot.append(per_token)
            itl.extend(gaps)
        tokens += n * t.batch_size
        requests += t.batch_size
        wall += e2e
    return {
        "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot) if tpot else None,
        "itl_ms": percentiles(itl) if itl else None, "e2el_ms": percentiles(e2el),
        "output_tokens": timings[0].output_tokens, "requests": requests,
        "output_tokens_per_s": tokens / (wall / 1e3), "requests_per_s": requests / (wall / 1e3),
        "total_output_tokens": tokens, "measured_s": wall / 1e3,
        "samples": call_samples(timings),
    }


def call_samples(timings: list[RequestTiming]) -> dict[str, list[float]]:
    """Each measured call's own TTFT, TPOT and E2EL (one value per call, not repeated per request) and every
    token gap of every call: what the percentiles summarize, for their spread (`trainprof diff`)."""
    return {"ttft_ms": [t.token_ms[0] for t in timings],
            "tpot_ms": [(t.end_ms - t.token_ms[0]) / (t.output_tokens - 1) for t in timings if t.output_tokens > 1],
            "e2el_ms": [t.end_ms for t in timings],
            "itl_ms": [float(g) for t in timings for g in np.diff(t.token_ms)]}
