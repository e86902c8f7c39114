#!/usr/bin/env bash
# The quality benchmark on one GPU, aiming at 8 minutes (docs/PARITY.md, "On a GPU": on an H200 the
# runner was host-bound and only the 1M size finished inside its limit): data-parallel
# and decoupled DiLoCo (M = 4, int4 both ways, equal tokens, about 9 tokens per parameter) for the
# llama family at about 1M, 6M and 25M parameters on the byte corpus, through the same runner,
# Syncer and apply rule as the CPU benchmark. One seed. The three sizes run at the same time as
# three processes sharing the GPU (the small ones are bound by the host, not the GPU), each with
# its own time limit; every size writes its log and JSON to OUT_DIR.
#
#   benchmarks/quality_gpu.sh [OUT_DIR]      # default: ./quality-gpu
#
# Needs JAX for the accelerator (pip install -e '.[cuda12]' or '.[cuda13]') in the python3 used.
# Tokens per run = steps x global batch x seq_len: 1M 450 x 64 x 256 = 7.4M (9.0 per parameter),
# 6M 1,750 x 128 x 256 = 57.3M (9.0), 25M 1,740 x 512 x 256 = 228M (9.0).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-quality-gpu}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
# Three processes share one GPU: none may take 75% of its memory up front (JAX's default).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
shift $(( $# > 0 ? 1 : 0 ))
extra=("$@")  # further parity.py flags for every size, e.g. --set outer.momentum_warmup_rounds=8

size() {  # size NAME SECONDS PRESET STEPS GLOBAL_BATCH
    local name="$1" limit="$2" preset="$3" steps="$4" batch="$5" started=$SECONDS
    echo "=== $name (limit ${limit}s): $preset, $steps steps, global batch $batch x 256"
    timeout --kill-after=10 "$limit" "$python" benchmarks/parity.py --seed 0 --scenarios uniform \
        --modes data_parallel,decoupled --presets "$preset" --steps "$steps" --global-batch "$batch" \
        --model seq_len=256 --model compute_dtype=bfloat16 --eval-batches 32 --json "$out/$name.json" \
        "${extra[@]}" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
}

nvidia-smi -L 2>/dev/null || true
"$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
size llama-1m 300 llama-1m 450 64 &
size llama-6m 330 llama-6m 1750 128 &
size llama-25m 450 llama-25m 1740 512 &
wait
for name in llama-1m llama-6m llama-25m; do
    echo "=== $name"
    grep -E "eval_loss|gap|total wall|Error|error" "$out/$name.log" | tail -n 8
done
exit 0
