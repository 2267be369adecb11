#!/usr/bin/env bash
# One-shot GPU check (H200 machine, no network; its preinstalled JAX, Flax, transformers).
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
# 1. the Pallas kernel tests, compiled (not interpreted), f32 dots at full precision; the Mosaic
#    GPU kernel's tests run on Hopper only; skipped (said in the log and the summary) where the
#    machine lacks pytest (they need no other test package);
# 2. ceilings: HBM copy bandwidth and bf16 matmul rate (the baselines);
# 3. kernel timings of both Pallas kernels (Triton, Mosaic GPU): decode 256 x 2k (Llama-3-8B heads,
#    bf16) and a mixed batch, against the plain-jnp path, JAX's decode-only Pallas kernel and the
#    copy bandwidth, outputs compared; the KV write (XLA scatter and Pallas kernel, outputs
#    compared); block-size sweeps;
# 4. the engine on a random-weight Llama-3-8B (bf16) with the kernel and KV write that measured
#    faster among those whose outputs matched the plain-jnp path's in part 3, at the sweeps' best
#    sizes: offline throughput (1000 x 128/128) and the decode step at batch 256 against its
#    roofline floor;
# 5. the tensor-parallel machinery on a mesh of one GPU against the unsharded path (a 1B-shaped
#    random-weight Llama, bf16): prefill and decode step times, same tokens (target: <= 5% more);
# 6. a Qwen3-30B-A3B mixture-of-experts layer (bf16): the grouped matmul's TFLOP/s and weight-read
#    bandwidth at decode batches 1-256 and a 4096-token prefill, whether XLA kept ragged_dot, and
#    the dense reference (in kernel.json);
# 7. quantized weights: Llama-3-8B's gate projection with fp8 / int8 / int4 weights through XLA's
#    dequantise-and-dot, and fp8 with per-token fp8 activations, against bf16 at decode batches and
#    a prefill; whether XLA wrote the dequantised weight to memory or ran an FP8 GEMM; decode
#    attention over an FP8 KV cache against bf16, by both Pallas kernels (in kernel.json);
# 8. speculative decoding: the 8B model's verify step (1 + 4 tokens a row) against its decode step
#    at batch 1 and 32, and an EAGLE-3 head's drafting step (one layer of its width, its LM head)
#    (in kernel.json);
# 9. LoRA: the 8B model's step with 8 rank-16 adapter slots on every target, rows spread over 8
#    adapters and over 1, against no row on an adapter, at decode batch 256 and a 2,048-token
#    prefill; whether XLA kept ragged_dot (in kernel.json);
# 10. DeepSeek-V3's latent attention at decode (one layer, 256 rows x 2k, absorbed through what
#    the engine picks for it): ms, the latent cache's bandwidth against the copy bandwidth, its output
#    against the decompressed form (in kernel.json);
# 11. a Gated DeltaNet layer of Qwen3.5-27B's shape in the plain form the engine runs: a decode step
#    of 64 rows (the states' bandwidth against the copy bandwidth) and a 512-token prompt chunk (in
#    kernel.json).
# Each part has its own time limit; a part whose limit would take the run past 590 s is skipped (logged),
# so the whole run ends within the device's 10-minute call with its summary; results land in
# OUT_DIR as JSON (gpu_check.json) and a table (gpu_check.md), printed last. Add --smoke to
# dry-run tiny sizes (also on the CPU).
set -u
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SMOKE="${2:-}"
cd "$(dirname "$0")/.."
# The source tree as the installed package, without installing it (the machine's venv stays as it
# is): the checkout comes first on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
PY="${PYTHON:-python3}"          # may carry options: left unquoted below
start=$SECONDS
log() { echo "[gpu_check $((SECONDS - start))s] $*"; }

# The device tool brings back at most 8 files from $OUT: these 8 are environment + logs
# (bench.log), kernel_tests.txt, ceilings/kernel/engine/sharding.json, gpu_check.json and gpu_check.md.
BENCH_LOG="$OUT_DIR/bench.log"
{ nvidia-smi; $PY -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'; } \
  > "$BENCH_LOG" 2>&1
log "environment: $(tail -1 "$BENCH_LOG")"

SKIPPED=""                       # summary rows of what did not run
skip() { log "$1: skipped, $2"; echo "=== $1: skipped ($2)" >> "$BENCH_LOG"; SKIPPED+="| $1 | skipped: $2 | - | - |"$'\n'; }

# The image's test packages are unknown and no registry is in reach: without pytest the kernel
# tests are skipped (the three files run here need nothing else: not hypothesis).
if ! $PY -c 'import pytest' > /dev/null 2>&1; then
  skip "kernel tests" "pytest is not installed"
  echo "skipped: pytest is not installed" > "$OUT_DIR/kernel_tests.txt"
else
  log "kernel tests (compiled)"
  # Without the image's own pytest plugins: none is needed, and one could need what is missing.
  JAX_DEFAULT_MATMUL_PRECISION=highest PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
    timeout 130 $PY -P -m pytest -v -p no:cacheprovider --import-mode=importlib tests/kernels/test_pallas_kernel.py \
    tests/kernels/test_kv_write.py tests/kernels/test_mosaic_kernel.py > "$OUT_DIR/kernel_tests.txt" 2>&1
  echo "exit status $?" >> "$OUT_DIR/kernel_tests.txt"
  log "kernel tests: $(grep -c ' PASSED' "$OUT_DIR/kernel_tests.txt") passed, $(grep -c ' FAILED' "$OUT_DIR/kernel_tests.txt") failed; $(tail -1 "$OUT_DIR/kernel_tests.txt")"
fi

for part in "ceilings 40" "kernel 115" "engine 150" "moe 35" "quantized 50" "speculation 40" "lora 30" "mla 30" \
    "hybrid 45"; do
  set -- $part
  if [ -z "$SMOKE" ] && [ $((SECONDS - start + $2 + 60)) -gt 590 ]; then   # the sharding part and the summary last
    skip "$1" "its time limit would end the run past 590 s"
    continue
  fi
  log "$1"
  echo "=== $1" >> "$BENCH_LOG"
  limit=$2; [ -n "$SMOKE" ] && limit=$((4 * limit))     # a dry run on a CPU interprets the kernels
  timeout "$limit" $PY scripts/bench_gpu.py "$1" --out "$OUT_DIR" $SMOKE >> "$BENCH_LOG" 2>&1
  echo "=== $1: exit status $?" >> "$BENCH_LOG"
done
log "sharding"
echo "=== sharding" >> "$BENCH_LOG"
SIZE=1b; [ -n "$SMOKE" ] && SIZE=cpu
timeout 60 $PY scripts/bench_sharding.py --size $SIZE --repeats 3 --out "$OUT_DIR/sharding.json" >> "$BENCH_LOG" 2>&1
echo "=== sharding: exit status $?" >> "$BENCH_LOG"
log "done; logs in $OUT_DIR"
$PY scripts/bench_gpu.py summary --out "$OUT_DIR"
if [ -n "$SKIPPED" ]; then                  # the summary's table, with what did not run
  printf '%s' "$SKIPPED" | tee -a "$OUT_DIR/gpu_check.md"
fi
