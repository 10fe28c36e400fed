"""`trainprof infer RECIPE [key=value ...] --batch 1,4,16`: serving metrics and a prefill/decode breakdown."""

from __future__ import annotations

import argparse
import sys

from trainprof.commands.run import non_negative_int, positive_int, positive_ints


def _infer(args: argparse.Namespace) -> int:
    import torch

    from trainprof.errors import UserError
    from trainprof.inference.checks import check_output_dir, check_serving_environment, load_inference_recipe
    from trainprof.inference.interrupt import InferInterrupted
    from trainprof.inference.report import stdout_table
    from trainprof.inference.run import InferSettings, check_settings, infer
    from trainprof.models import resolve_shape

    recipe = load_inference_recipe(args.recipe, args.overrides)
    if args.output_dir is not None:
        recipe.output.dir = args.output_dir
    from_flag = args.output_dir is not None
    check_output_dir(recipe.output.dir, from_flag)  # before check_environment's, which names output.dir only
    check_serving_environment(recipe, cuda_available=torch.cuda.is_available())
    max_len = resolve_shape(recipe.model).max_position_embeddings
    if args.prompt_len + args.new_tokens > max_len:
        raise UserError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the model's "
                        f"max_position_embeddings {max_len}; shorten them")
    settings = InferSettings(batch_sizes=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                             requests=args.requests, warmup=args.warmup, ops=not args.no_ops)
    check_settings(recipe, settings)
    check_output_dir(recipe.output.dir, from_flag, create=True)  # last: a refused command creates nothing
    try:
        run_dir = infer(recipe, settings)
    except InferInterrupted as stopped:  # what finished is kept; one line says what and where
        print(f"trainprof: {stopped}", file=sys.stderr)
        return stopped.exit_code
    import json

    print(stdout_table(json.loads((run_dir / "inference.json").read_text())))
    print(f"run dir: {run_dir}  (inference.json, inference.md, inference.html; tensorboard --logdir {run_dir}/tb)")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("infer", help="serving metrics (TTFT, TPOT, ITL, throughput) and a prefill/decode breakdown",
                       description="Serve the recipe's model with Hugging Face generate (static KV cache, greedy, "
                       "fixed output length) at several batch sizes; report vLLM-defined latency metrics, KV-cache "
                       "bytes, peak memory, prefill MFU, decode bandwidth, and per-module / per-operator prefill and "
                       "decode times. Writes <output.dir>/<recipe>-infer-<UTC timestamp>/. Ctrl-C or SIGTERM keeps "
                       "the batch sizes that finished (inference.json marked partial, inference.interrupted.json) "
                       "and exits 130 / 143.")
    p.add_argument("recipe", help="recipe YAML file (its model and task; LoRA adapters are merged; its engine "
                   "section is not used: one process, no ZeRO)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.dtype=fp32")
    p.add_argument("--batch", type=positive_ints, default=[1, 4, 16], help="batch sizes, comma-separated (default 1,4,16)")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--new-tokens", type=positive_int, default=128,
                   help="output tokens per request, fixed: eos disabled (default 128; >= 2 for TPOT)")
    p.add_argument("--requests", type=positive_int, default=5, help="measured generate calls per batch size (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="unmeasured generate calls per batch size first (default 2; >= 1 with model.compile=true, "
                   "whose first call compiles)")
    p.add_argument("--output-dir", default=None, help="parent of the run dir (default: the recipe's output.dir)")
    p.add_argument("--no-ops", action="store_true", help="skip the operator-level trace (torch.profiler)")
    p.set_defaults(func=_infer)
    return p
