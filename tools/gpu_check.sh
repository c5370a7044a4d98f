#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (tools/README.md says how to call it and what it prints).
#
# GPU_CHECK_PART=fused (the default: issue 28's fused path, under 8 minutes with the machine's start),
# in this order, each step under its own time limit inside one overall budget, each run even when an
# earlier one failed, the summary rewritten after every step:
#   device        nvidia-smi; CuPy, CUDA runtime/driver, NVRTC, torch versions
#   install       pip install -e . without network or build isolation (fallback: --target /tmp)
#   imports       sparsecore; the CUDA headers NVRTC gets (kernel_registry.cuda_include_dir) and whether
#                 crt/mma.h (wmma) is found there or in the toolkit
#   kernels       tools/gpu_kernel_report.py: cold compile seconds per kernel file (empty CUPY_CACHE_DIR,
#                 which every later step then reuses), registers / shared memory / spills per instantiation
#   correctness   pytest -m gpu on the new path's tests (implicit GEMM, pool maps, rulebook maps, the core
#                 through the kernel backend): per dtype passed / failed / skipped
#   hostops       tools/host_operations.py on CuPy, per layer, compared with the same count on the CPU
#                 emulation made in the background during the steps before (they must be equal)
#   layers        tools/gpu_layer_times.py: each conv layer's forward, input gradient and weight gradient
#                 timed on the GPU (CUDA events per launch), the current kernels and issue 28's (3ed261f:
#                 .peer/old_kernels/kernels_cu, else git archive) side by side, each beside the modelled
#                 time of tools/gpu_layer_estimate.py, computed on the CPU in the background from the start
#   benchmark     python -m sparsecore.benchmark gpu: basic and large, forward with builds and backward,
#                 float32 / float16 / TF32, against spconv native and implicit GEMM in the same process,
#                 per-layer time with TFLOP/s, two runs bitwise, the SubMConv3d 64->64 memory row
#   targets       python -m sparsecore.benchmark targets: one PASS / FAIL / NOT MEASURED line per device target
#   capture       tools/capture_check.py: the basic network's forward and training step, eager against a
#                 torch CUDA graph and a CuPy graph (capacity mode), per step, against spconv (issue 36)
# The spconv bundle (.peer/, tools/prepare_gpu_carry.sh) unpacks in the background from the start.
#
# GPU_CHECK_PART=standing: issue 29's other checks (every other gpu test, torch on CUDA, the demos, the
# JAX benchmark, tools/gpu_profile.py) after device, install and imports. GPU_CHECK_PART=all: both.
#
# Results go to $OUT (the device tool's folder that comes back; /tmp/sparsecore_gpu_check elsewhere), at
# most 8 files: gpu_check.md (everything below, in order), gpu_check.log (every step's output),
# gpu_kernels.json, pytest_gpu.log, host_ops_gpu.json, host_ops_emulation.json, gpu_benchmark.json,
# gpu_benchmark.txt.
#
# Environment: GPU_CHECK_BUDGET_S (default 480 s for fused, 420 for standing, 575 for all), PYTHON
# (default python3), GPU_CHECK_SKIP_INSTALL=1 (dry runs where sparsecore is installed already),
# GPU_CHECK_SKIP_PEER=1 (leave the spconv bundle packed),
# GPU_CHECK_HOSTOPS_SCENE (default basic; the layers step's scene too), GPU_CHECK_HOSTOPS_DEVICE (default cuda; emulation for a dry
# run), GPU_CHECK_HOSTOPS_ARGS (more arguments for both counts, e.g. "--layers 3"), GPU_CHECK_CORRECTNESS
# (test files, space-separated, instead of the default patterns), GPU_CHECK_KERNEL_FILES (comma-separated
# kernel files for the report instead of all), GPU_CHECK_BENCHMARK_ARGS (more arguments for the benchmark,
# e.g. "--scene basic" for a rerun).
set -u -o pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-/tmp/sparsecore_gpu_check}
mkdir -p "$out"
part=${GPU_CHECK_PART:-fused}
case $part in
  fused) default_budget=480 ;;
  standing) default_budget=420 ;;
  all) default_budget=575 ;;
  *) echo "GPU_CHECK_PART must be fused, standing or all, got $part" >&2; exit 2 ;;
esac
budget=${GPU_CHECK_BUDGET_S:-$default_budget}
py=${PYTHON:-python3}
log=$out/gpu_check.log
summary=$out/gpu_check.md
: >"$log"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX tests must not take most of the GPU from CuPy
export SPARSECORE_DATA_DIR=$root/data  # the scans travel in the working tree
scratch=$(mktemp -d)
export CUPY_CACHE_DIR=$scratch/cupy_cache  # empty: the kernel report's compiles are cold; later steps reuse them
mkdir -p "$CUPY_CACHE_DIR"
began=$SECONDS
steps=()
step_rc=0
declare -A background_pid background_start

record() {  # record NAME EXIT SECONDS LIMIT
  steps+=("$1|$2|$3|$4")
}

run_step() {  # run_step NAME CAP_SECONDS LOGFILE COMMAND... (the command runs under timeout)
  local name=$1 cap=$2 logfile=$3
  shift 3
  local left=$((budget - (SECONDS - began)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then
    record "$name" "skipped: ${left} s of the budget left" 0 "$cap"
    echo "== $name: skipped, ${left} s left" | tee -a "$log"
    step_rc=125
    write_summary
    return
  fi
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$logfile" 2>&1
  step_rc=$?
  local shown=$step_rc
  [ "$step_rc" -eq 124 ] && shown="124 (ran past ${limit} s)"
  record "$name" "$shown" $((SECONDS - start)) "$limit"
  echo "== $name: exit $shown after $((SECONDS - start)) s" | tee -a "$log"
  [ "$logfile" != "$log" ] && { echo "--- $name output:"; tail -n 200 "$logfile"; } >>"$log" 2>/dev/null
  write_summary
}

start_background() {  # start_background NAME CAP LOGFILE COMMAND...: runs beside the next steps
  local name=$1 cap=$2 logfile=$3
  shift 3
  echo "== $name (in the background, limit ${cap} s): $*" | tee -a "$log"
  timeout -k 10 "$cap" "$@" >>"$logfile" 2>&1 &
  background_pid[$name]=$!
  background_start[$name]=$SECONDS
}

finish_background() {  # finish_background NAME WAIT_SECONDS: waits for it at most that long
  local name=$1 wait_for=$2 pid=${background_pid[$1]:-}
  [ -z "$pid" ] && return
  local waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$wait_for" ]; do
    sleep 1
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    record "$name" "stopped: still running after $((SECONDS - background_start[$name])) s" \
      $((SECONDS - background_start[$name])) "-"
  else
    wait "$pid"
    local rc=$?
    local shown=$rc
    [ "$rc" -eq 124 ] && shown="124 (ran past its limit)"
    record "$name" "$shown" $((SECONDS - background_start[$name])) "background"
  fi
  unset "background_pid[$name]"
  echo "== $name: ${steps[-1]}" | tee -a "$log"
  write_summary
}

section() {  # section TITLE FILE [LINES]: a fenced block of the file's last lines, if it has any
  [ -s "$2" ] || return 0
  echo "## $1"
  echo '```'
  tail -n "${3:-80}" "$2"
  echo '```'
  echo
}

write_summary() {  # gpu_check.md, rewritten after every step
  {
    echo "# tools/gpu_check.sh ($part), $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - began)) s of ${budget}"
    echo
    echo "commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "| step | exit | seconds | limit |"
    echo "| --- | --- | ---: | ---: |"
    for entry in "${steps[@]}"; do echo "| ${entry//|/ | } |"; done
    echo
    section "device and versions" "$scratch/device.txt" 40
    section "imports and CUDA headers" "$scratch/imports.txt" 40
    section "kernels: cold compile per file, resources per instantiation" "$scratch/kernels.txt" 200
    section "correctness per dtype (pytest -m gpu on the new path)" "$scratch/correctness_summary.txt" 60
    section "host operations per layer on the GPU (tools/host_operations.py --device cuda)" \
      "$scratch/host_ops_gpu.txt" 120
    section "host operations: GPU against the emulation" "$scratch/host_ops_compare.txt" 60
    section "per-layer device time, current and issue 28's kernels, beside the estimate (tools/gpu_layer_times.py)" \
      "$scratch/layer_times.txt" 200
    section "the estimate's totals and targets (tools/gpu_layer_estimate.py, CPU)" "$scratch/layer_estimate_totals.txt" 30
    [ -s "$scratch/benchmark.md" ] && { sed 's/^# sparsecore network benchmark/## benchmark (gpu suite)/' \
      "$scratch/benchmark.md"; echo; }
    section "per-layer rows (time, GFLOP, TFLOP/s; all of them in gpu_benchmark.txt)" "$scratch/layers.txt" 260
    section "benchmark output (last lines)" "$scratch/benchmark_tail.txt" 30
    section "device targets" "$scratch/targets.txt" 40
    section "standing checks: pytest -m gpu (last lines)" "$scratch/standing_pytest.txt" 45
    section "standing checks: demos and the JAX benchmark (last lines)" "$scratch/frontends.txt" 40
    section "standing checks: tools/gpu_profile.py (the start)" "$scratch/profile_head.txt" 25
  } >"$summary"
}

fused=0
standing=0
[ "$part" = fused ] || [ "$part" = all ] && fused=1
[ "$part" = standing ] || [ "$part" = all ] && standing=1
write_summary

# --- the spconv bundle and the wheels it lacks, unpacked outside the checkout, in the background
# (.peer/ must stay small enough to carry: a site/ left in it would not be)
peer_site=/tmp/sparsecore_peer_site
if [ "${GPU_CHECK_SKIP_PEER:-0}" = 1 ]; then
  record peer "skipped (GPU_CHECK_SKIP_PEER=1)" 0 "-"
elif [ -s .peer/spconv_site.tar.xz ]; then
  start_background peer 150 "$log" bash -c "rm -rf $peer_site && mkdir -p $peer_site && \
    xz -dc .peer/spconv_site.tar.xz | tar -C $peer_site -xf - && for wheel in .peer/wheels/*.whl; do \
    [ -e \"\$wheel\" ] && $py -m zipfile -e \"\$wheel\" $peer_site; done; ls $peer_site"
  export PYTHONPATH=$peer_site${PYTHONPATH:+:$PYTHONPATH}
else
  record peer "skipped: no .peer/spconv_site.tar.xz (run tools/prepare_gpu_carry.sh, carry .peer)" 0 "-"
fi
[ -f data/lidar_voxels_125k.npz ] || echo "warning: no data/lidar_voxels_125k.npz in the working tree" | tee -a "$log"

# --- device and versions
cat >"$scratch/device.py" <<'PY'
import platform
import sys

print("python", platform.python_version(), sys.executable)
import cupy

properties = cupy.cuda.runtime.getDeviceProperties(0)
name = properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
      cupy.cuda.runtime.driverGetVersion(), "|", name, f"sm_{properties['major']}{properties['minor']}",
      properties["multiProcessorCount"], "SMs", f"{properties['totalGlobalMem'] / 2**30:.0f} GiB")
from cupy_backends.cuda.libs import nvrtc

print("NVRTC", nvrtc.getVersion())
import torch

print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPU visible:", torch.cuda.is_available())
PY
run_step device 30 "$scratch/device.txt" bash -c \
  "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; $py $scratch/device.py"

# --- install
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  record install "skipped (GPU_CHECK_SKIP_INSTALL=1)" 0 "-"
else
  run_step install 90 "$log" "$py" -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir -e .
  if [ "$step_rc" -ne 0 ]; then
    run_step install-target 90 "$log" "$py" -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-cache-dir --target /tmp/sparsecore_site .
    export PYTHONPATH=/tmp/sparsecore_site:$PYTHONPATH
  fi
fi

# --- imports (python -P: the checkout's sparsecore/ must not shadow the installed package)
run_step imports 45 "$scratch/imports.txt" "$py" -P -c "import os, sparsecore
from sparsecore.backends import kernel_registry
print('sparsecore', sparsecore.__version__, sparsecore.__file__)
print('CUDA headers (kernel_registry.cuda_include_dir):', kernel_registry.cuda_include_dir())
tensor_core = getattr(kernel_registry, 'tensor_core_include_dir', None)
print('crt/mma.h for wmma (kernel_registry.tensor_core_include_dir):', tensor_core() if tensor_core else 'no such function')
options = kernel_registry.nvrtc_options()
print('NVRTC options:', ' '.join(options))
for option in options:
    if option.startswith('-I'):
        print('  crt/mma.h in', option[2:] + ':', os.path.isfile(os.path.join(option[2:], 'crt', 'mma.h')))
for toolkit in filter(None, (os.environ.get('CUDA_PATH'), os.environ.get('CUDA_HOME'), '/usr/local/cuda')):
    print('  crt/mma.h in', toolkit + '/include (toolkit):', os.path.isfile(os.path.join(toolkit, 'include', 'crt', 'mma.h')))"

timeout_flag=()
thread_timeout=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then
  timeout_flag=(--timeout=60)
  thread_timeout=(--timeout=40 --timeout-method=thread)
fi

if [ "$fused" = 1 ]; then
  # --- the emulation's count of the same network, in the background (CPU cores; needs g++)
  hostops_scene=${GPU_CHECK_HOSTOPS_SCENE:-basic}
  if command -v "${CXX:-g++}" >/dev/null; then
    start_background hostops-emulation 300 "$scratch/host_ops_emulation.txt" "$py" -P tools/host_operations.py \
      --scene "$hostops_scene" --sites 0 --memory --json "$out/host_ops_emulation.json" ${GPU_CHECK_HOSTOPS_ARGS:-}
  else
    record hostops-emulation "skipped: no g++ on this machine (the emulation compiles the kernels with it)" 0 "-"
  fi

  # --- the per-layer estimate (CPU: the maps of the scene, the tile tables), in the background
  start_background layers-estimate 150 "$scratch/layer_estimate.txt" "$py" -P tools/gpu_layer_estimate.py \
    --scene "$hostops_scene" --json "$scratch/layer_estimate.json"

  # --- kernels: cold compile per file and resources per instantiation
  run_step kernels 100 "$scratch/kernels_log.txt" "$py" -P tools/gpu_kernel_report.py \
    --cache-dir "$CUPY_CACHE_DIR" --json "$out/gpu_kernels.json" --output "$scratch/kernels.txt" \
    --files "${GPU_CHECK_KERNEL_FILES:-}"

  # --- correctness: the new path's gpu tests, per dtype
  if [ -n "${GPU_CHECK_CORRECTNESS:-}" ]; then
    read -r -a correctness <<<"$GPU_CHECK_CORRECTNESS"
  else
    correctness=()
    for file in tests/test_implicit_gemm*.py tests/test_pool_maps*.py tests/test_rulebook_maps*.py \
        tests/test_neighbour_map*.py tests/test_fused*.py tests/test_kernel_backend.py; do
      [ -f "$file" ] && correctness+=("$file")
    done
  fi
  run_step correctness 90 "$out/pytest_gpu.log" "$py" -P -m pytest -m gpu -q -p no:cacheprovider -rfE \
    --durations=10 "${timeout_flag[@]}" --junitxml="$scratch/correctness.xml" "${correctness[@]}"
  cat >"$scratch/per_dtype.py" <<'PY'
import collections
import re
import sys
import xml.etree.ElementTree as ElementTree

DTYPES = ("float64", "float32", "float16", "bfloat16", "tf32", "int8")
try:
    tree = ElementTree.parse(sys.argv[1])
except (OSError, ElementTree.ParseError) as error:
    sys.exit(f"no test results: {error}")
counts, failed = collections.defaultdict(collections.Counter), []
for case in tree.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
               else "skipped" if case.find("skipped") is not None else "passed")
    named = [dtype for dtype in DTYPES if re.search(rf"(?<![A-Za-z]){dtype}(?![0-9])", name)]
    for dtype in named or ["no dtype in the test id"]:
        counts[dtype][outcome] += 1
    if outcome == "failed":
        failed.append(name)
for dtype, outcomes in counts.items():
    print(f"{dtype:<24} {outcomes['passed']:4d} passed {outcomes['failed']:4d} failed {outcomes['skipped']:4d} skipped")
print("files:", " ".join(sys.argv[2:]))
print("failed:", *(failed or ["none"]), sep="\n  ")
PY
  "$py" "$scratch/per_dtype.py" "$scratch/correctness.xml" "${correctness[@]}" >"$scratch/correctness_summary.txt" 2>&1
  tail -n 3 "$out/pytest_gpu.log" >>"$scratch/correctness_summary.txt" 2>/dev/null
  write_summary

  # --- host operations per layer on the GPU, against the emulation's (which must be done by now)
  finish_background hostops-emulation 60
  compare=()
  [ -s "$out/host_ops_emulation.json" ] && compare=(--compare "$out/host_ops_emulation.json")
  run_step hostops 60 "$scratch/host_ops_gpu.txt" "$py" -P tools/host_operations.py \
    --device "${GPU_CHECK_HOSTOPS_DEVICE:-cuda}" --scene "$hostops_scene" --sites 0 --memory \
    --json "$out/host_ops_gpu.json" "${compare[@]}" ${GPU_CHECK_HOSTOPS_ARGS:-}
  if [ "${#compare[@]}" -eq 0 ]; then
    echo "no emulation count to compare with (see hostops-emulation in the steps)" >"$scratch/host_ops_compare.txt"
  else
    sed -n '/^compared with /,$p' "$scratch/host_ops_gpu.txt" >"$scratch/host_ops_compare.txt"
  fi
  { echo "--- the emulation's count:"; cat "$scratch/host_ops_emulation.txt"; } >>"$log" 2>/dev/null
  write_summary

  # --- each conv layer's passes timed, current and issue 28's kernels, beside the estimate
  finish_background layers-estimate 45
  grep -E "^total |^[a-z0-9]+ (old|new): " "$scratch/layer_estimate.txt" >"$scratch/layer_estimate_totals.txt" 2>/dev/null
  old_kernels=()
  if [ -f .peer/old_kernels/kernels_cu/implicit_gemm.cu ]; then
    old_kernels=(--old-kernels .peer/old_kernels/kernels_cu)
  elif mkdir -p "$scratch/old_kernels" && git -C "$root" archive 3ed261f kernels_cu 2>/dev/null | \
      tar -x -C "$scratch/old_kernels" 2>/dev/null && [ -f "$scratch/old_kernels/kernels_cu/implicit_gemm.cu" ]; then
    old_kernels=(--old-kernels "$scratch/old_kernels/kernels_cu")
  fi
  run_step layers 75 "$scratch/layer_times.txt" "$py" -P tools/gpu_layer_times.py --scene "$hostops_scene" \
    --repeats 5 --time-limit 55 --estimate-json "$scratch/layer_estimate.json" "${old_kernels[@]}"
  { echo "--- the estimate (tools/gpu_layer_estimate.py):"; cat "$scratch/layer_estimate.txt"; } >>"$log" 2>/dev/null
  write_summary

  # --- the networks against spconv, per-layer time, the memory row; then the targets
  finish_background peer 60
  run_step import-spconv 45 "$scratch/imports.txt" "$py" -P -c "import spconv, spconv.pytorch, torch
print('spconv', spconv.__version__, spconv.__file__)"
  left=$((budget - (SECONDS - began) - 20))
  bench_cap=$((left < 200 ? left : 200))
  run_step benchmark "$bench_cap" "$out/gpu_benchmark.txt" "$py" -P -m sparsecore.benchmark gpu \
    --max-seconds 1.5 --warmup 2 --profile-runs 1 --time-limit $((bench_cap > 90 ? bench_cap - 45 : bench_cap / 2)) \
    --child-timeout $((bench_cap > 90 ? bench_cap - 40 : bench_cap / 2)) \
    --json "$out/gpu_benchmark.json" --markdown "$scratch/benchmark.md" ${GPU_CHECK_BENCHMARK_ARGS:-}
  grep -E " L[0-9]{2} (SubMConv3d|SparseMaxPool3d)" "$out/gpu_benchmark.txt" | cut -c1-330 >"$scratch/layers.txt"
  tail -n 30 "$out/gpu_benchmark.txt" >"$scratch/benchmark_tail.txt"
  write_summary
  run_step targets 20 "$scratch/targets.txt" "$py" -P -m sparsecore.benchmark targets "$out/gpu_benchmark.json"
  # --- issue 36: the basic network eager vs captured (torch CUDA graph, CuPy graph), per step
  run_step capture 60 "$scratch/capture.txt" "$py" -P tools/capture_check.py --scene "$hostops_scene" --repeats 5
  { echo "--- capture (tools/capture_check.py):"; cat "$scratch/capture.txt"; } >>"$log" 2>/dev/null
fi

if [ "$standing" = 1 ]; then
  finish_background peer 60
  smoke=(tests/test_jax_gpu.py::test_callback_equals_jnp_through_a_network_under_scan)
  run_step pytest-torch-cuda 60 "$scratch/standing_pytest.txt" "$py" -P -m pytest -m gpu -q \
    -p no:cacheprovider -x --durations=5 "${thread_timeout[@]}" tests/test_torch_cuda.py
  run_step pytest-other 150 "$scratch/standing_pytest.txt" "$py" -P -m pytest -m gpu -q -p no:cacheprovider \
    --continue-on-collection-errors --durations=15 "${timeout_flag[@]}" --deselect tests/test_torch_cuda.py \
    "${smoke[@]/#/--deselect=}" tests
  run_step jax-scan 60 "$scratch/standing_pytest.txt" "$py" -P -m pytest -m gpu -q -p no:cacheprovider \
    "${timeout_flag[@]}" "${smoke[@]}"
  run_step demo-cuda 45 "$scratch/frontends.txt" "$py" -P -m sparsecore.demo --device cuda
  run_step demo-jax 60 "$scratch/frontends.txt" "$py" -P -m sparsecore.demo --device cuda --frontend jax
  run_step jax-benchmark 60 "$scratch/frontends.txt" "$py" -P -m sparsecore.jax.benchmark --voxels 100000 \
    --channels 32 64 --reps 5
  run_step profile 40 "$scratch/profile.txt" "$py" -P tools/gpu_profile.py --repeat 5 \
    --output "$scratch/profile_full.txt"
  head -n 25 "$scratch/profile_full.txt" >"$scratch/profile_head.txt" 2>/dev/null
  cat "$scratch/standing_pytest.txt" >>"$out/pytest_gpu.log" 2>/dev/null
  { echo "--- tools/gpu_profile.py:"; cat "$scratch/profile_full.txt"; } >>"$log" 2>/dev/null
fi

for name in "${!background_pid[@]}"; do finish_background "$name" 0; done
write_summary

# The reply shows the end of the output: steps, kernels, correctness, host operations, networks, targets.
echo
sed -n '/^| step /,/^$/p' "$summary"
if [ "$fused" = 1 ]; then
  grep -E "^total |^instantiations with spills" "$scratch/kernels.txt" 2>/dev/null
  head -n 8 "$scratch/correctness_summary.txt" 2>/dev/null
  grep -E "^(forward|backward)" "$scratch/host_ops_gpu.txt" 2>/dev/null
  head -n 4 "$scratch/host_ops_compare.txt" 2>/dev/null
  grep -E "^(== |total )" "$scratch/layer_times.txt" 2>/dev/null
  grep -E "^[a-z0-9]+ (old|new): " "$scratch/layer_estimate_totals.txt" 2>/dev/null
  grep -E "^\| .* network \||^\| memory " "$scratch/benchmark.md" 2>/dev/null | cut -c1-300
  cat "$scratch/targets.txt" 2>/dev/null
fi
[ "$standing" = 1 ] && grep -E "passed|failed|error" "$scratch/standing_pytest.txt" 2>/dev/null | tail -n 4
echo "full summary: $summary"
rm -rf "$scratch"
