#!/usr/bin/env bash
# One-shot GPU check (issue 12), on a machine with a CUDA GPU and the `gpu` extra installed:
#
#   OUT=results/ bash jobs/gpu_check.sh   # steps capped at 30+90+150+300+120 s
#
# It runs, in this order, each step's output teed to $OUT (what comes back from the machine):
#   env.txt       nvidia-smi, python, torch / triton / numba / numpy versions
#   aot.txt       every codec kernel compiled for this GPU's arch, PTX checked (no FMA, IEEE div)
#   tests.txt     the device codec's tests compiled on CUDA (exact against numba / numpy), the
#                 CUDA-only tests (the device mean into CUDA gradients bit-exact with the CPU's
#                 among them), and the codec corpus digest (the wire format did not move)
#   bench.txt     python -m jobs.bench_gpu (codec GB/s side by side, DDP step times), and
#   bench_gpu.json  the same figures as JSON (commit them to docs/gpu.md with the GPU named)
#   traffic.txt   python -m jobs.backend_traffic: Tail's traffic and low-rank layers on the CPU
#                 and the Triton backend over the same digits gradients (should agree)
#
# The machine's image has torch, triton, numba and numpy but not this package and no network:
# it runs from the source tree (PYTHONPATH=.), nothing is installed. Every step runs even if
# an earlier one failed; the exit status is the first failure's. Time: ~1 min of kernel and
# numba compilation, ~1 min of tests, 2-4 min of benchmark on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=token
export HOME="${GPU_CHECK_HOME:-/tmp/tail_ray_gpu_home}"  # numba's kernel cache lives under it
mkdir -p "$HOME"
unset TRITON_INTERPRET TAIL_RAY_CODEC_BACKEND
PY="${PYTHON:-python3}"
status=0
step() {  # step NAME TIMEOUT_S CMD...: run, tee to $OUT/NAME.txt, remember the first failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee "$OUT/$name.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$OUT/$name.txt"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

step env 30 bash -c "nvidia-smi; $PY -c 'import sys, torch, triton, numba, numpy; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available()); \
print(\"triton\", triton.__version__, \"numba\", numba.__version__, \"numpy\", numpy.__version__); \
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'"
arch=$($PY -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(10 * m + n)' 2>/dev/null || echo 90)
step aot 90 "$PY" -m tail_ray.compression.triton_aot --arch "$arch"
step tests 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
  tests/compression/test_triton_codec.py tests/compression/test_triton_dither.py tests/compression/test_codec_corpus.py \
  tests/compression/test_lowrank_device.py \
  tests/jobs/test_bench_gpu.py \
  tests/collective/test_decode_average.py
step bench 300 "$PY" -m jobs.bench_gpu --json "$OUT/bench_gpu.json"
step traffic 120 "$PY" -m jobs.backend_traffic
echo "gpu_check: exit $status (outputs in $OUT)"
exit "$status"
