#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (tools/README.md says how to call it).
#
# Steps, each with its own time limit inside one overall budget, each run even
# when an earlier one failed:
#   device     nvidia-smi, CuPy's and torch's view of the GPU
#   peer       unpack the carried spconv bundle and wheels of .peer/ into /tmp (tools/prepare_gpu_carry.sh)
#   install    pip install -e . without network or build isolation (fallback: --target /tmp)
#   imports    sparsecore + CuPy + the CUDA headers NVRTC needs; spconv.pytorch
#   pytest     pytest -m gpu: a smoke subset of the GPU integrations first, the torch CUDA tests, then the others
#              (--durations=15 each; the GPU tests run wherever CuPy sees a device)
#   benchmark  python -m sparsecore.benchmark gpu (JSON and Markdown rewritten after every case)
#   frontends  python -m sparsecore.demo --device cuda, with torch and with --frontend jax, and
#              python -m sparsecore.jax.benchmark (impl="callback" against impl="jnp") on the GPU
#   profile    tools/gpu_profile.py: host time per CuPy operation, launches per pass, cProfile
# Results go to $OUT (the device tool's folder that comes back; /tmp/sparsecore_gpu_check
# elsewhere): gpu_check.md (steps, device, test summary, benchmark table), gpu_check.log,
# pytest_gpu.log, gpu_benchmark.txt, gpu_benchmark.json, gpu_benchmark.md, gpu_frontends.txt, gpu_profile.txt.
#
# Environment: GPU_CHECK_BUDGET_S (default 520 s in all), PYTHON (default python3),
# GPU_CHECK_SKIP_INSTALL=1 (dry runs on a machine where sparsecore is installed already).
set -u -o pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-/tmp/sparsecore_gpu_check}
mkdir -p "$out"
budget=${GPU_CHECK_BUDGET_S:-520}
py=${PYTHON:-python3}
log=$out/gpu_check.log
: >"$log"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX tests must not take most of the GPU from CuPy
export SPARSECORE_DATA_DIR=$root/data  # the scans travel in the working tree
began=$SECONDS
steps=()
step_rc=0

run_step() {  # run_step NAME CAP_SECONDS LOGFILE COMMAND... (the command runs under timeout)
  local name=$1 cap=$2 logfile=$3
  shift 3
  local left=$((budget - (SECONDS - began)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    steps+=("$name|skipped: ${left} s of the budget left|0")
    echo "== $name: skipped, ${left} s left" | tee -a "$log"
    step_rc=125
    return
  fi
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$logfile" 2>&1
  step_rc=$?
  local shown=$step_rc
  [ "$step_rc" -eq 124 ] && shown="124 (ran past ${limit} s)"
  steps+=("$name|$shown|$((SECONDS - start))")
  echo "== $name: exit $shown after $((SECONDS - start)) s" | tee -a "$log"
}

# --- device
scratch=$(mktemp -d)
cat >"$scratch/device.py" <<'PY'
import platform
import sys

print("python", platform.python_version(), sys.executable)
import cupy

properties = cupy.cuda.runtime.getDeviceProperties(0)
name = properties["name"].decode() if isinstance(properties["name"], bytes) else properties["name"]
print("cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver",
      cupy.cuda.runtime.driverGetVersion(), "|", name, f"sm_{properties['major']}{properties['minor']}",
      properties["multiProcessorCount"], "SMs")
import torch

print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPU visible:", torch.cuda.is_available())
PY
run_step device 45 "$scratch/device.txt" bash -c \
  "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; $py $scratch/device.py"
cat "$scratch/device.txt" >>"$log" 2>/dev/null

# --- peer: spconv bundle and the wheels it lacks, unpacked outside the checkout
# (.peer/ must stay small enough to carry: a site/ left in it would not be)
peer_site=/tmp/sparsecore_peer_site
if [ -s .peer/spconv_site.tar.xz ]; then
  run_step peer 120 "$log" bash -c "rm -rf $peer_site && mkdir -p $peer_site && \
    xz -dc .peer/spconv_site.tar.xz | tar -C $peer_site -xf - && for wheel in .peer/wheels/*.whl; do \
    [ -e \"\$wheel\" ] && $py -m zipfile -e \"\$wheel\" $peer_site; done; ls $peer_site"
  export PYTHONPATH=$peer_site${PYTHONPATH:+:$PYTHONPATH}
else
  steps+=("peer|skipped: no .peer/spconv_site.tar.xz (run tools/prepare_gpu_carry.sh, carry .peer)|0")
fi
[ -f data/lidar_voxels_125k.npz ] || echo "warning: no data/lidar_voxels_125k.npz in the working tree: the benchmark cannot run on the real scan" | tee -a "$log"

# --- install
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  steps+=("install|skipped (GPU_CHECK_SKIP_INSTALL=1)|0")
else
  run_step install 120 "$log" "$py" -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir -e .
  if [ "$step_rc" -ne 0 ]; then
    run_step install-target 120 "$log" "$py" -m pip install -q --no-index --no-deps --no-build-isolation \
      --no-cache-dir --target /tmp/sparsecore_site .
    export PYTHONPATH=/tmp/sparsecore_site:$PYTHONPATH
  fi
fi

# --- imports (python -P: the checkout's sparsecore/ must not shadow the installed package)
run_step import-sparsecore 60 "$scratch/imports.txt" "$py" -P -c "import sparsecore, cupy
from sparsecore.backends import kernel_registry
print('sparsecore', sparsecore.__version__, sparsecore.__file__)
print('CUDA headers for NVRTC:', kernel_registry.cuda_include_dir())"
run_step import-spconv 60 "$scratch/imports.txt" "$py" -P -c "import spconv, spconv.pytorch, torch
print('spconv', spconv.__version__, spconv.__file__)"
cat "$scratch/imports.txt" >>"$log" 2>/dev/null

# --- GPU tests: a smoke subset first (one test of each GPU integration: the core's conv and pools on
# CuPy, cuBLAS products, torch on CUDA streams, JAX's callback on XLA's stream), so that a short budget
# still says the most; then every other gpu test. --durations shows where the time went.
timeout_flag=()
"$py" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout=60)
# The torch CUDA tests run in a step of their own with pytest-timeout's thread method: on
# 2026-12-04 (H200) tests/test_torch_cuda.py printed nothing for 55 s on cold caches, past a 45 s
# signal timeout (warm, it ran in 23 s); the thread method dumps every thread's stack even when
# the time goes outside Python (compilers), and ends the run.
smoke=(
  tests/test_kernel_backend.py::test_conv_forward_and_backward_match_numpy
  tests/test_kernel_backend.py::test_pooling_matches_numpy
  tests/test_jax_gpu.py::test_callback_equals_jnp_through_a_network_under_scan
)
deselect=(--deselect tests/test_torch_cuda.py)
for node in "${smoke[@]}"; do deselect+=(--deselect "$node"); done
run_step pytest-smoke 100 "$out/pytest_gpu.log" "$py" -P -m pytest -m gpu -q -p no:cacheprovider \
  --durations=15 "${timeout_flag[@]}" "${smoke[@]}"
thread_timeout=()
"$py" -c "import pytest_timeout" 2>/dev/null && thread_timeout=(--timeout=40 --timeout-method=thread)
run_step pytest-torch-cuda 60 "$out/pytest_gpu.log" "$py" -P -m pytest -m gpu -q -p no:cacheprovider -x \
  --durations=5 "${thread_timeout[@]}" tests/test_torch_cuda.py
run_step pytest 150 "$out/pytest_gpu.log" "$py" -P -m pytest -m gpu -q -p no:cacheprovider \
  --continue-on-collection-errors --durations=15 "${timeout_flag[@]}" "${deselect[@]}"

# --- benchmark (at most 160 s, so that the demos and the profile below still run)
left=$((budget - (SECONDS - began)))
bench_cap=$((left < 160 ? left : 160))
run_step benchmark "$bench_cap" "$out/gpu_benchmark.txt" "$py" -P -m sparsecore.benchmark gpu \
  --max-seconds 2 --time-limit $((bench_cap > 90 ? bench_cap - 40 : bench_cap / 2)) \
  --child-timeout 120 --json "$out/gpu_benchmark.json" --markdown "$out/gpu_benchmark.md"

# --- the frontends on the GPU: the demo through torch and through JAX, the JAX callback against
# jnp; then where the host time goes
run_step demo-cuda 45 "$out/gpu_frontends.txt" "$py" -P -m sparsecore.demo --device cuda
run_step demo-jax 60 "$out/gpu_frontends.txt" "$py" -P -m sparsecore.demo --device cuda --frontend jax
run_step jax-benchmark 60 "$out/gpu_frontends.txt" "$py" -P -m sparsecore.jax.benchmark --voxels 100000 \
  --channels 32 64 --reps 5
run_step profile 40 "$scratch/profile.txt" "$py" -P tools/gpu_profile.py --repeat 5 \
  --output "$out/gpu_profile.txt"

# --- summary
summary=$out/gpu_check.md
{
  echo "# tools/gpu_check.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - began)) s"
  echo
  echo "| step | exit | seconds |"
  echo "| --- | --- | ---: |"
  for entry in "${steps[@]}"; do echo "| ${entry//|/ | } |"; done
  echo
  echo "## device and imports"
  echo '```'
  cat "$scratch/device.txt" "$scratch/imports.txt" 2>/dev/null | tail -n 40
  echo '```'
  echo
  echo "## pytest -m gpu (last lines)"
  echo '```'
  tail -n 45 "$out/pytest_gpu.log" 2>/dev/null
  echo '```'
  echo
  if [ -s "$out/gpu_benchmark.md" ]; then
    sed 's/^# sparsecore network benchmark/## benchmark (python -m sparsecore.benchmark gpu)/' "$out/gpu_benchmark.md"
  else
    echo "## benchmark: no table; last lines of its output"
    echo '```'
    tail -n 25 "$out/gpu_benchmark.txt" 2>/dev/null
    echo '```'
  fi
  echo
  echo "## frontends: the demo (torch, then JAX) and the JAX benchmark (last lines)"
  echo '```'
  tail -n 40 "$out/gpu_frontends.txt" 2>/dev/null
  echo '```'
  echo
  echo "## tools/gpu_profile.py (the start; all of it in gpu_profile.txt)"
  echo '```'
  head -n 25 "$out/gpu_profile.txt" 2>/dev/null
  echo '```'
} >"$summary"

# The reply shows the end of the output: the steps, the test summary, the network rows.
echo
sed -n '/^| step /,/^$/p' "$summary"
grep -E "passed|failed|error" "$out/pytest_gpu.log" 2>/dev/null | tail -n 3
grep -E "^\| .* network \||^\| memory " "$summary" | cut -c1-400
echo "full table: $summary"
rm -rf "$scratch"
