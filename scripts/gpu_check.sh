#!/usr/bin/env bash
# The checks only a GPU can run, in one call (a lent GPU is scarce): the GPU tests, the reference
# recipe on one GPU (DeepSpeed ZeRO-3 and plain PyTorch), QLoRA's 4-bit base on CUDA, and (with
# --project) the projection of the ZeRO-3 run to other accelerators, which measures this GPU's
# calibration (GEMM rate, copy bandwidth) into its run dir. --megatron: llama2-1b on megatron-core and on
# DeepSpeed ZeRO-1 at the same micro batch and seq_len, their diff, and the Megatron GPU tests.
#
#   bash scripts/gpu_check.sh [--project] [--qlora] [--tests] [--megatron] OUTDIR
#
# Run dirs (without their tb/ traces) are packed into OUTDIR/runs.tgz, the log into OUTDIR/gpu_check.log.
# Missing Python packages can sit as wheels in .whl/ (installed into /tmp/site first).
set -u
project=0; qlora=0; tests=0; megatron=0
while [ $# -gt 1 ]; do
  case "$1" in --project) project=1;; --qlora) qlora=1;; --tests) tests=1;; --megatron) megatron=1;;
    *) echo "unknown option $1"; exit 2;; esac
  shift
done
out=${1:?usage: gpu_check.sh [--project] [--qlora] [--tests] [--megatron] OUTDIR}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
echo "TORCH_CUDA_ARCH_LIST as found: '${TORCH_CUDA_ARCH_LIST:-}'"
# DeepSpeed 0.19.8's JIT op builder cannot parse arch suffixes ('9.0a': "invalid literal for int() ... '0a'"),
# which the CUDA image sets; FusedAdam only needs the plain compute capability.
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
runs=/tmp/trainprof_runs
rm -rf "$runs"; mkdir -p "$runs"
step() {  # step NAME TIMEOUT_S CMD...: time one step, keep going when it fails
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date -u +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
}
newest() { ls -td "$runs"/*/ 2>/dev/null | head -1; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name())"

if [ "$tests" = 1 ]; then
  export TRAINPROF_GPU_TEST_OUT=$out/gpu_test_steps.json
  step "GPU tests" 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profiler_gpu.py tests/test_infer.py
fi
step "llama1b ZeRO-3 (DeepSpeed, 1 GPU)" 300 \
  python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run recipes/llama1b_zero3_sdpa.yaml output.dir=$runs
zero3=$(newest)
if [ "$project" = 1 ] && [ -n "$zero3" ]; then
  step "project to h100-sxm,h200" 120 \
    python3 -m trainprof project "$zero3" --to h100-sxm,h200 --gpus-per-node 1 --no-probe
fi
step "llama1b plain PyTorch (1 GPU)" 180 \
  python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run recipes/llama1b_zero3_sdpa.yaml \
  engine.kind=torch engine.zero_stage=0 output.dir=$runs
if [ "$qlora" = 1 ]; then
  step "llama2-7b QLoRA (bitsandbytes 4-bit, ZeRO-2)" 240 \
    python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run recipes/llama70b_qlora.yaml \
    model.name=llama2-7b train.steps=8 output.dir=$runs
fi
# --- Megatron vs DeepSpeed, one GPU (issue 28; docs/megatron.md) ---------------------------------------
# megatron-core is not in the GPU image: carry its cp312 wheel in .whl/ (docs/megatron.md says how).
if [ "$megatron" = 1 ]; then
  if python3 -c "import megatron.core" 2>/dev/null; then
    same="train.micro_batch_size=8 data.seq_len=350 model.attention=sdpa model.recompute=false"
    step "GPU tests: Megatron engine" 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_megatron.py
    step "llama1b Megatron + distributed optimizer (1 GPU)" 300 \
      python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run recipes/llama1b_megatron.yaml $same output.dir=$runs
    megatron_run=$(newest)
    step "llama1b DeepSpeed ZeRO-1 (1 GPU, same micro batch and seq_len)" 300 \
      python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run recipes/llama1b_zero3_sdpa.yaml \
      engine.zero_stage=1 $same output.dir=$runs
    deepspeed_run=$(newest)
    if [ -n "$megatron_run" ] && [ -n "$deepspeed_run" ] && [ "$megatron_run" != "$deepspeed_run" ]; then
      step "diff DeepSpeed ZeRO-1 -> Megatron" 120 python3 -m trainprof diff "$deepspeed_run" "$megatron_run"
    fi
  else
    echo "=== Megatron steps skipped: megatron-core is not importable (no wheel in .whl/)"
  fi
fi
# --- end of the Megatron block ------------------------------------------------------------------------

for d in "$runs"/*/; do
  echo "--- $d"; head -c 1500 "$d/summary.md" 2>/dev/null; echo
done
tar czf "$out/runs.tgz" --exclude=tb --exclude='profile.rank*.json' -C "$runs" .
ls -la "$out"
