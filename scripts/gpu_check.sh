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
#
# The GPU program (issue 27; /work/shared/GPU.md): what a lent GPU machine runs first, one command per
# part, each within the device tool's 10 minutes (steps that no longer fit are skipped and named):
#
#   bash scripts/gpu_wheels.sh                                  # on the CPU machine: .whl/ (14 MiB)
#   bash scripts/gpu_check.sh --program core OUTDIR             # on the GPU, carry .whl/
#   bash scripts/gpu_check.sh --program lora OUTDIR             # the same machine, a second command
#   bash scripts/gpu_check.sh --program core --dry-run OUTDIR   # anywhere: the command list, every recipe loaded
#
# Plan per GPU kind (H100 first, then H200; ~15 min of machine time each, start included; the times
# are estimates until a GPU session writes the measured ones into docs/gpu_program.md):
#   start of the machine                                                         1-2 min
#   --program core (<= 9.5 min; in this order, each step skipped when its limit no longer fits):
#     wheels + versions                                                          ~0.5 min
#     GPU tests: CUDA-event timer, torch.cuda._sleep ground truth, NVML, infer   ~1.5 min
#     llama2-1b plain PyTorch, GPU-bound (micro batch 16 x seq 1024)             ~1.5 min
#     llama2-1b DeepSpeed ZeRO-3, GPU-bound (the same; FusedAdam JIT-built)      ~2.5 min
#     profiler overhead bench (llama2-1b GPU-bound, Llama2-7B LoRA)              ~2.5 min
#     llama2-1b ZeRO-3 and plain PyTorch, host-bound (micro batch 8 x seq 350)   what time is left
#   --program lora (<= 4 min): Llama2-7B LoRA bf16 (ZeRO-2), Llama2-7B QLoRA NF4   ~3.5 min
#   --program size (<= 6 min): the GPU-bound plain PyTorch step at seven other shapes (depth, GQA, vocabulary,
#     7B, 13B and 70B width at a few layers; SIZE_RUNS="NAME OVERRIDES...;..." picks), then scripts/memory_at_peak.py
#     on ZeRO-3 32 x 1024 recompute and 7B QLoRA (plan's misses)
#   --program zero2 (<= 5 min): llama2-1b DeepSpeed ZeRO-2, host-bound (8 x 350) and GPU-bound: the host
#     reference a ZeRO-1/2 target needs (the catalog has ZeRO-3's and plain PyTorch's only)
#   --program memory (<= 5 min): size's memory_at_peak.py part alone (7B LoRA, ZeRO-3 recompute, 7B QLoRA);
#   --program zero2_memory: zero2 then memory, one command (<= 9.5 min; memory steps skipped by the budget
#     when zero2 ran long)
#   --program recompute (<= 7 min): 7B QLoRA and ZeRO-3 32 x 1024 recompute again (as <kind>-*-v2), then memory
#   --program lora_v2 (<= 5.5 min): lora's two runs again (as <kind>-*-v2), for kinds whose lora runs held re-run graphs
#   --program zero2_lora_v2 (<= 9.5 min): zero2, lora_v2, then memory (one archive per run, one for memory)
#   --program offload (<= 8 min): llama1b DeepSpeed ZeRO-3 and ZeRO-2 with engine.offload=optimizer (CPU Adam
#     JIT-built on the first): the host's optimizer step and the PCIe copies an offload target needs
#   --program qlora_shapes (<= 9.5 min): QLoRA NF4 (ZeRO-2) at 70B width x 2 layers, 13B x 8 layers, 7B at micro
#     batch 4 and 7B x 16 layers: the held-out shapes a host cost of bitsandbytes' calls needs
# Each kept run leaves OUTDIR/<kind>-<name>/ as profiles/ keeps it: profile.json (CUDA-event profile,
# NVML telemetry, GPU busy per phase), summary.md, recipe.yaml, calibration.json and the one traced
# step's Kineto trace (rank0.*.pt.trace.json.gz; no stacks, no shapes), packed as OUTDIR/<kind>-<name>.tgz
# (the device tool returns 8 files at most); the bench's <kind>-overhead/overhead.json likewise. The log's
# last lines name every step that failed or was skipped; the exit code is 0 only when none did.
# The H100 -> H200 projection of the kept pairs runs afterwards on a CPU, from profiles/ (calibration.json).

# the program's options; the rest are the per-part flags parsed below
program=""; dry_run=0; rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --program) program=${2:-}; shift
      case "$program" in core|lora|lora_v2|zero2_lora_v2|pair|extra|size|zero2|memory|zero2_memory|recompute|offload|qlora_shapes) ;; *) echo "--program takes core, lora, lora_v2, zero2_lora_v2, pair, extra, size, zero2, memory, zero2_memory, recompute, offload or qlora_shapes, not '$program'"; exit 2;; esac;;
    --dry-run) dry_run=1;;
    *) rest+=("$1");;
  esac
  shift
done
set -- ${rest[@]+"${rest[@]}"}
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
failed=()  # steps that failed or were skipped, listed at the end of the log
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if [ "$dry_run" = 0 ]; then
echo "TORCH_CUDA_ARCH_LIST as found: '${TORCH_CUDA_ARCH_LIST:-}'"
# DeepSpeed 0.19.8's JIT op builder cannot parse arch suffixes ('9.0a': "invalid literal for int() ... '0a'"),
# which the CUDA image sets; FusedAdam only needs the plain compute capability.
export TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
fi
if [ "$dry_run" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || failed+=("installing the carried wheels (.whl/)")
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
runs=/tmp/trainprof_runs
[ "$dry_run" = 1 ] && runs=$out/runs
rm -rf "$runs"; mkdir -p "$runs"
budget_s=${GPU_CHECK_BUDGET_S:-570}  # the device tool stops a command at 600 s: keep time to pack OUTDIR
step() {  # step NAME TIMEOUT_S CMD...: time one step, keep going when it fails; skipped when it no longer fits
  local name=$1 limit=$2; shift 2
  if [ "$dry_run" = 1 ]; then
    printf '%s\t%s\n' "$name" "$*" >> "$out/commands.tsv"; echo "=== $name (dry run): $*"; return 0
  fi
  if [ $((budget_s - SECONDS)) -lt "$limit" ]; then
    echo "=== $name: skipped, its $limit s no longer fit ($SECONDS s of $budget_s s used)"
    failed+=("$name: skipped, $SECONDS s of $budget_s s used"); return 0
  fi
  echo "=== $name ($(date -u +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed+=("$name: rc=$rc after $((SECONDS - t0)) s")
}
newest() { if [ "$dry_run" = 1 ]; then echo "$runs/RUN/"; else ls -td "$runs"/*/ 2>/dev/null | head -1; fi; }

if [ "$dry_run" = 0 ]; then
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name())"
fi
kind=dry
[ "$dry_run" = 0 ] && kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')

# --- the GPU program (issue 27) --------------------------------------------------------------------------
# what every kept run traces and measures: one traced step (after one discarded Kineto warm-up step), no
# stacks or shapes (a trace of a few MB), calibration.json for the projection, NVML telemetry (default on)
KEEP="profile.ops=true profile.ops_steps=1 profile.trace_warmup=1 profile.with_stack=false profile.record_shapes=false \
profile.trace_gzip=true profile.calibrate=true"
GPU_BOUND="train.micro_batch_size=16 data.seq_len=1024 train.steps=10"  # = bench_overhead_cuda.py's llama2-1b step
TORCH="engine.kind=torch engine.zero_stage=0"
# The device tool brings back at most 8 files of 16 MiB from OUTDIR: each kept folder travels as one
# archive, OUTDIR/<kind>-NAME.tgz (`tar xzf OUTDIR/<kind>-NAME.tgz -C profiles/` puts it in place).
kept=/tmp/trainprof_kept
[ "$dry_run" = 1 ] && kept=$out/kept
rm -rf "$kept"; mkdir -p "$kept"
pack() {  # pack NAME: OUTDIR/<kind>-NAME.tgz from $kept/<kind>-NAME/ (without its trace if over 15 MiB)
  local folder=$kind-$1
  tar czf "$out/$folder.tgz" -C "$kept" "$folder"
  if [ "$(stat -c %s "$out/$folder.tgz")" -gt $((15 * 1048576)) ]; then
    tar czf "$out/$folder.tgz" --exclude='*.pt.trace.json.gz' -C "$kept" "$folder"
    failed+=("$1: trace left out, the archive was over the 16 MiB a returned file may have")
  fi
  echo "--- kept $folder.tgz ($(stat -c %s "$out/$folder.tgz") bytes):"; tar tzvf "$out/$folder.tgz"
}
TRACE_GLOB='tb/*/rank0.*.pt.trace.json.gz'  # rank 0's trace in a run dir (layout.tb_run_dir; tests/test_gpu_program.py)
keep() {  # keep NAME RUN_DIR: what profiles/ keeps of the run, packed as OUTDIR/<kind>-NAME.tgz
  local name=$1 run=$2 dest="$kept/$kind-$1"
  [ "$dry_run" = 1 ] && return 0
  if [ ! -f "$run/profile.json" ]; then
    echo "--- $name: no profile.json in $run, nothing kept"; failed+=("$name: no profile.json"); return 0
  fi
  mkdir -p "$dest"
  cp "$run/profile.json" "$run/summary.md" "$run/recipe.yaml" "$dest/"
  gzip -9 -n "$dest/profile.json"  # profiles/ keeps it gzipped: the tree travels with every device call
  [ -f "$run/calibration.json" ] && cp "$run/calibration.json" "$dest/"
  # shellcheck disable=SC2086  # TRACE_GLOB is a pattern
  local trace; trace=$(ls "$run"/$TRACE_GLOB 2>/dev/null | head -1)
  if [ "${KEEP_TRACE:-1}" = 0 ]; then :
  elif [ -n "$trace" ]; then cp "$trace" "$dest/"; else failed+=("$name: no trace in $run/tb"); fi
  [ "${KEEP_PACK:-1}" = 0 ] || pack "$name"
}
run_recipe() {  # run_recipe NAME LIMIT_S RECIPE [KEY=VALUE...]: one run on this GPU, kept as <kind>-NAME
  local name=$1 limit=$2; shift 2
  local before; before=$(newest)
  # shellcheck disable=SC2086  # KEEP is a list of overrides
  step "$name" "$limit" python3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run "$@" $KEEP output.dir=$runs
  local after; after=$(newest)
  if [ "$dry_run" = 1 ] || [ "$after" != "$before" ]; then keep "$name" "$after"; else
    failed+=("$name: no run dir written"); fi
}
program_core() {
  export TRAINPROF_GPU_TEST_OUT=$runs/gpu_test_steps.json  # into runs.tgz: OUTDIR keeps to 8 files
  step "GPU tests" 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profiler_gpu.py \
    tests/test_profiler_gpu_sleep.py tests/test_telemetry.py tests/test_infer.py
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-torch-gpubound 150 recipes/llama1b_zero3_sdpa.yaml $TORCH $GPU_BOUND
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-gpubound 240 recipes/llama1b_zero3_sdpa.yaml $GPU_BOUND
  step "profiler overhead bench" 200 python3 scripts/bench_overhead.py --device cuda --pairs 20 \
    --json-out "$kept/$kind-overhead/overhead.json"
  [ -f "$kept/$kind-overhead/overhead.json" ] && pack overhead
  run_recipe llama1b_zero3_sdpa-hostbound 150 recipes/llama1b_zero3_sdpa.yaml
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-torch-hostbound 110 recipes/llama1b_zero3_sdpa.yaml $TORCH
}
program_pair() {  # the GPU-bound pair alone (their traces, when core ran without them)
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-torch-gpubound 150 recipes/llama1b_zero3_sdpa.yaml $TORCH $GPU_BOUND
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-gpubound 240 recipes/llama1b_zero3_sdpa.yaml $GPU_BOUND
}
program_extra() {  # what a kind's core run skipped: ZeRO-3 busy >= 80% (twice the work, recomputed), host-bound torch
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-gpubound32 200 recipes/llama1b_zero3_sdpa.yaml $GPU_BOUND train.micro_batch_size=32 model.recompute=true
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-torch-hostbound 110 recipes/llama1b_zero3_sdpa.yaml $TORCH
}
program_size() {  # issue 24: the GPU-bound torch step at other model shapes (no traces: profiles/ travels with
  # every device call), then what is live at the peaks plan misses (docs/memory.md)
  local s
  local shapes; IFS=';' read -ra shapes <<< "${SIZE_RUNS:-half_depth model.num_layers=11;gqa4 model.num_kv_heads=4;\
7b_width4 model.name=llama2-7b model.num_layers=4;13b_width2 model.name=llama2-13b model.num_layers=2;\
70b_width1 model.name=llama2-70b model.num_layers=1;7b_width8 model.name=llama2-7b model.num_layers=8;\
vocab48k model.vocab_size=48000}"
  for s in "${shapes[@]}"; do
    # shellcheck disable=SC2086
    KEEP_TRACE=0 KEEP_PACK=0 run_recipe llama1b_zero3_sdpa-torch-gpubound-${s%% *} 100 recipes/llama1b_zero3_sdpa.yaml $TORCH $GPU_BOUND ${s#* }
  done
  program_memory
}
program_memory() {  # issue 24 (d): what is live at the peaks plan misses, and where each block was freed
  mkdir -p "$kept/$kind-memory"
  local m=(python3 -m torch.distributed.run --nproc_per_node 1 scripts/memory_at_peak.py)
  local quiet="profile.ops=false profile.calibrate=false profile.telemetry_period_ms=0 output.dir=$runs"
  # the plan's one open miss first: LoRA's forward/backward peak planned 3.4% high (docs/memory.md)
  # shellcheck disable=SC2086
  step "memory at peak: Llama2-7B LoRA" 120 "${m[@]}" "$kept/$kind-memory/llama7b_lora.json" \
    recipes/llama13b_lora.yaml model.name=llama2-7b train.steps=3 $quiet
  # shellcheck disable=SC2086
  step "memory at peak: ZeRO-3 32 x 1024 recompute" 130 "${m[@]}" --no-stacks "$kept/$kind-memory/zero3_gpubound32.json" \
    recipes/llama1b_zero3_sdpa.yaml $GPU_BOUND train.micro_batch_size=32 model.recompute=true train.steps=3 $quiet
  # shellcheck disable=SC2086
  step "memory at peak: Llama2-7B QLoRA" 150 "${m[@]}" "$kept/$kind-memory/llama7b_qlora.json" \
    recipes/llama70b_qlora.yaml model.name=llama2-7b train.steps=3 $quiet
}
pack_all() {  # pack_all NAME: every kept folder as one OUTDIR/<kind>-NAME.tgz (the device tool returns 8 files at most)
  if [ "$dry_run" = 0 ] && ls -d "$kept/$kind"-* >/dev/null 2>&1; then
    (cd "$kept" && tar czf "$out/$kind-$1.tgz" "$kind"-*) && echo "--- kept $kind-$1.tgz:" && tar tzvf "$out/$kind-$1.tgz"
  fi
}
program_zero2() {  # issue 24: a ZeRO-2 target's host per operator call, which ZeRO-3's hooks inflate
  run_recipe llama1b_zero3_sdpa-zero2-hostbound 150 recipes/llama1b_zero3_sdpa.yaml engine.zero_stage=2
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-zero2-gpubound 200 recipes/llama1b_zero3_sdpa.yaml engine.zero_stage=2 $GPU_BOUND
}
program_zero2_memory() {  # both of issue 24's GPU parts in one command (about 7 min: zero2, then memory)
  KEEP_PACK=0 program_zero2
  program_memory
}
program_recompute() {  # issue 24 (d): the recompute runs again since the profiler lets go of re-run graphs
  run_recipe llama7b_qlora-v2 200 recipes/llama70b_qlora.yaml model.name=llama2-7b train.steps=8
  # shellcheck disable=SC2086
  run_recipe llama1b_zero3_sdpa-gpubound32-v2 200 recipes/llama1b_zero3_sdpa.yaml $GPU_BOUND train.micro_batch_size=32 model.recompute=true
  KEEP_PACK=0 program_memory
}
program_lora() {  # LORA_SUFFIX=-v2: the runs again, kept beside the first ones
  local v=${LORA_SUFFIX:-}
  run_recipe llama7b_lora$v 120 recipes/llama13b_lora.yaml model.name=llama2-7b train.steps=8
  run_recipe llama7b_qlora$v 200 recipes/llama70b_qlora.yaml model.name=llama2-7b train.steps=8
}
program_lora_v2() { LORA_SUFFIX=-v2 program_lora; }
program_qlora_shapes() {  # issue 24: QLoRA at shapes besides 7B's. CPU -> GPU QLoRA reads 33-50% low (bitsandbytes'
  # calls are not in the host model) and its only GPU runs are one recipe's: a per-call cost fitted there needs
  # other widths, depths and batches to be checked on. Widest first (the 70B's 8192), each a few layers.
  run_recipe llama70b_qlora-2layers 120 recipes/llama70b_qlora.yaml model.num_layers=2 train.steps=8
  run_recipe llama13b_qlora-8layers 150 recipes/llama70b_qlora.yaml model.name=llama2-13b model.num_layers=8 train.steps=8
  run_recipe llama7b_qlora-mb4 200 recipes/llama70b_qlora.yaml model.name=llama2-7b train.micro_batch_size=4 train.steps=8
  run_recipe llama7b_qlora-16layers 150 recipes/llama70b_qlora.yaml model.name=llama2-7b model.num_layers=16 train.steps=8
}
program_offload() {  # issue 24: engine.offload on a GPU runs DeepSpeed's CPU Adam on the host and copies the
  # gradients and parameters over PCIe; no catalog row describes a host, so the projection waits for these
  run_recipe llama1b_zero3_sdpa-offload-hostbound 270 recipes/llama1b_zero3_sdpa.yaml engine.offload=optimizer train.steps=10
  run_recipe llama1b_zero3_sdpa-zero2-offload-hostbound 180 recipes/llama1b_zero3_sdpa.yaml engine.zero_stage=2 \
    engine.offload=optimizer train.steps=10
}
program_zero2_lora_v2() {  # what an H200 still lacks since the hooks fix: the ZeRO-2 pair, LoRA/QLoRA, LoRA's peak
  program_zero2
  program_lora_v2
  program_memory
  [ "$dry_run" = 1 ] || pack memory
}
if [ -n "$program" ]; then
  tests=0  # the program runs its own GPU tests first
  "program_$program"
  case "$program" in size|memory|zero2_memory|recompute) pack_all "$program";; esac
fi
# --- end of the GPU program -------------------------------------------------------------------------------

if [ "$tests" = 1 ]; then
  export TRAINPROF_GPU_TEST_OUT=$out/gpu_test_steps.json
  step "GPU tests" 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profiler_gpu.py tests/test_infer.py
fi
if [ -z "$program" ]; then  # the reference recipe once on each engine, as before the program existed
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
fi
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
if [ "${#failed[@]}" -gt 0 ]; then
  echo "=== failed or skipped (${#failed[@]}):"; printf '  %s\n' "${failed[@]}"
else
  echo "=== every step passed ($SECONDS s)"
fi
if [ "$dry_run" = 1 ]; then  # every command parses, every recipe and override loads, every file exists
  python3 scripts/gpu_check_commands.py "$out/commands.tsv" || exit 1
fi
[ "${#failed[@]}" = 0 ]
