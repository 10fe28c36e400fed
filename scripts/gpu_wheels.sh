#!/usr/bin/env bash
# The wheels the GPU image lacks (docs: /work/shared/GPU.md), built or downloaded on this machine into the
# ignored .whl/, which the device tool carries to the GPU machine (64 MiB a call at most) and
# scripts/gpu_check.sh installs there (pip --no-index --no-deps --target /tmp/site).
#
#   bash scripts/gpu_wheels.sh                                  # writes .whl/ and prints what a device call carries
#   GPU_WHEELS_SKIP="torchao megatron-core" bash scripts/gpu_wheels.sh   # without those (the core, lora and
#                                                               # size programs need neither)
#
# The 64 MiB a call carries counts the whole working tree (profiles/ included) with .whl/: the script
# fails when the two together do not fit, naming the sizes.
#
# - deepspeed: built from its sdist with DS_BUILD_OPS=0 (pure Python; FusedAdam is JIT-built on the GPU,
#   which gpu_check.sh allows by setting TORCH_CUDA_ARCH_LIST to the plain capability);
# - bitsandbytes: the manylinux wheel slimmed to its CPU library and the CUDA 13.0 one the image's torch
#   (2.11+cu130) loads (the full wheel carries every CUDA and ROCm build: 43 MB);
# - torchao, megatron-core: binary wheels for CPython 3.12 (the image's Python), manylinux x86_64;
# - their dependencies the image lacks (hjson, pydantic and pydantic-core, jsonschema and its referencing
#   stack), by the image's package list (/work/.library/device/KINDS.md: ninja, py-cpuinfo, msgpack,
#   einops and attrs are there), and typing-extensions, whose version there may be older than pydantic's floor.
# Versions: the ones installed and tested on this machine, so the GPU runs what the CPU suite ran.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
limit_mib=64
py_version=3.12
bnb_cuda=${BNB_CUDA:-130}  # libbitsandbytes_cuda<ver>.so to keep: torch.version.cuda on the image, no dot
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_28_x86_64)

installed() {  # installed VERSION of a distribution on this machine
  python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}
pin() { echo "$1==$(installed "$1")"; }

rm -rf "$dest"
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "deepspeed $(installed deepspeed): built from the sdist without prebuilt ops"
DS_BUILD_OPS=0 pip wheel -q --no-cache-dir --no-deps --no-build-isolation "$(pin deepspeed)" -w "$dest"

echo "binary wheels for CPython $py_version"
binaries=(torchao megatron-core bitsandbytes hjson pydantic pydantic-core annotated-types typing-inspection
          typing-extensions jsonschema jsonschema-specifications referencing rpds-py)
pins=()
for name in "${binaries[@]}"; do
  case " ${GPU_WHEELS_SKIP:-} " in *" $name "*) echo "  skipping $name (GPU_WHEELS_SKIP)"; continue;; esac
  pins+=("$(pin "$name")")
done
pip download -q --no-deps --only-binary=:all: --python-version "$py_version" --implementation cp \
  "${platforms[@]}" -d "$tmp" "${pins[@]}"

echo "bitsandbytes: keeping libbitsandbytes_cpu and libbitsandbytes_cuda$bnb_cuda only"
python3 - "$tmp" "$dest" "$bnb_cuda" <<'EOF'
"""Copy the downloaded wheels to .whl/, rewriting bitsandbytes' without the native libraries the GPU
image cannot use (its RECORD rewritten to match, so pip installs it as any other wheel)."""
import re
import shutil
import sys
import zipfile
from pathlib import Path

src, dest, keep_cuda = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
native = re.compile(r"^bitsandbytes/libbitsandbytes_(\w+?)\.(so|dll|dylib)$")
for wheel in sorted(src.glob("*.whl")):
    if not wheel.name.startswith("bitsandbytes-"):
        shutil.copy(wheel, dest / wheel.name)
        continue
    dropped = set()
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dest / wheel.name, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            m = native.match(info.filename)
            if m and m.group(1) not in ("cpu", f"cuda{keep_cuda}"):
                dropped.add(info.filename)
        if not any(n.endswith(f"libbitsandbytes_cuda{keep_cuda}.so") for n in zin.namelist()):
            sys.exit(f"gpu_wheels.sh: {wheel.name} has no libbitsandbytes_cuda{keep_cuda}.so; set BNB_CUDA")
        for info in zin.infolist():
            if info.filename in dropped:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",")[0] not in dropped).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    print(f"  dropped {len(dropped)} native libraries: {wheel.stat().st_size / 2**20:.1f} MiB -> "
          f"{(dest / wheel.name).stat().st_size / 2**20:.1f} MiB")
EOF

ls -la "$dest"
size=$(du -sb "$dest" | cut -f1)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | paste -sd+ | bc)
printf '.whl/: %d wheels, %.1f MiB; with the working tree (%.1f MiB) a device call carries %.1f MiB of at most %d\n' \
  "$(ls "$dest"/*.whl | wc -l)" "$(echo "$size / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" \
  "$(echo "($size + $tree) / 1048576" | bc -l)" "$limit_mib"
if [ $((size + tree)) -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_wheels.sh: .whl/ and the working tree are over $limit_mib MiB together; skip wheels a program does not" \
    "need (GPU_WHEELS_SKIP=\"torchao megatron-core\") or slim one further" >&2
  exit 1
fi
