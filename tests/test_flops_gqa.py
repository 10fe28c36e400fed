"""Grouped-query attention's FLOPs: as many heads as the query has, on every SDPA kernel's formula (torch
2.11's formulas reject GQA shapes; the GPU image runs it)."""
import torch

from trainprof.profiler.flops import FORMULAS, FlopCounter, as_multi_head

aten = torch.ops.aten
B, HQ, HKV, S, D = 2, 8, 2, 16, 32
FULL_FORWARD = 4 * B * HQ * S * S * D  # two bmm of the query's heads: 2 FLOPs a multiply-add


def test_flop_counter_counts_gqa_attention_with_the_querys_heads():
    q = torch.randn(B, HQ, S, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, S, D, requires_grad=True) for _ in range(2))
    counter = FlopCounter(lambda: (0, "forward"))
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert dict(counter.counts) == {(0, "forward"): int(FULL_FORWARD * 3.5)}  # backward 2.5x forward


def test_cuda_kernels_gqa_arguments_widen_to_the_querys_heads():
    # the CUDA kernels' argument layouts, on CPU tensors: only the shapes matter to the formulas
    q, k, v = torch.empty(B, HQ, S, D), torch.empty(B, HKV, S, D), torch.empty(B, HKV, S, D)
    name = "_scaled_dot_product_cudnn_attention"
    args = as_multi_head(name, (q, k, v, None))
    assert [a.shape[1] for a in args[:3]] == [HQ] * 3 and args[1].device.type == "meta" and args[3] is None
    assert FORMULAS[aten._scaled_dot_product_cudnn_attention](*args, out_val=None) == FULL_FORWARD
    # (B, S, H, D) kernels, backward: grad_out first
    g, q2, k2 = torch.empty(B, S, HQ, D), torch.empty(B, S, HQ, D), torch.empty(B, S, HKV, D)
    widened = as_multi_head("_efficient_attention_backward", (g, q2, k2, k2.clone(), None))
    assert [a.shape[2] for a in widened[:4]] == [HQ] * 4
    # full multi-head attention and other ops are left as given
    assert as_multi_head(name, (q, q, q)) == (q, q, q)
    assert as_multi_head("mm", (k, v)) == (k, v)
