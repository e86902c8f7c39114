#!/usr/bin/env bash
# The quality ladder on one accelerator (docs/PARITY.md, "Quality by size"): data-parallel against
# decoupled DiLoCo (M = 4, defaults, int4 both ways) at equal tokens, llama presets of 6.4M and
# 25.3M parameters, 10 tokens per parameter, bf16, seq_len 256, seed 0, each rung under its own
# time limit (the 25.3M rung only with LADDER_25M=1: it does not fit the one device pass). With
# LADDER_BUDGET_S (seconds this script may take, from its start), the sparse recipe's decoupled row
# (quality_ladder.py --recipe sparseloco) follows each int4 rung when at least a minute is left,
# limited to what is left. Rows go into one JSON after every rung:
#   benchmarks/results/accelerator/<UTC date>/quality.json   (copied to OUT_DIR/quality.json)
# The corpus is this tree's benchmarks/corpus/stdlib-seed0.npz when present (write it where the
# CPU figures were measured: quality_ladder.py --save-corpus benchmarks/corpus/stdlib-seed0.npz,
# and carry benchmarks/corpus with the tree), else the device machine's own standard library.
#
#   benchmarks/quality_ladder.sh [OUT_DIR]                 # default: ./quality-ladder
#   LADDER_SMOKE=1 benchmarks/quality_ladder.sh /tmp/q     # the same script at a tiny size, on the CPU
#
# Needs JAX for the accelerator in the python3 used (or PYTHON=...); the smoke run needs none.
# Tokens per rung = 10 x params: 6m 1,942 steps x 128 x 256 = 63.6M; 25m 1,931 steps x 512 x 256 = 253M.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-quality-ladder}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
json="${LADDER_JSON:-benchmarks/results/accelerator/$(date -u +%F)/quality.json}"
corpus=()
[[ -f benchmarks/corpus/stdlib-seed0.npz ]] && corpus=(--corpus benchmarks/corpus/stdlib-seed0.npz)

rung() {  # rung NAME SECONDS ARGS...: one preset under its own limit; log to OUT/NAME.log
    local name="$1" limit="$2" started=$SECONDS; shift 2
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$python" benchmarks/quality_ladder.py "$@" "${corpus[@]}" --json "$json" \
        >"$out/$name.log" 2>&1
    local rc=$?
    grep -E "rows in|Error|error" "$out/$name.log" | tail -n 4
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
}

sparse_rung() {  # sparse_rung NAME ARGS...: the sparse recipe's row, only within LADDER_BUDGET_S
    local name="$1" left=$(( ${LADDER_BUDGET_S:-0} - SECONDS )); shift
    if (( left < 60 )); then
        echo "=== $name: skipped (${left}s of LADDER_BUDGET_S=${LADDER_BUDGET_S:-unset} left)"
        return
    fi
    rung "$name" "$left" "$@" --recipe sparseloco
}

if [[ -n "${LADDER_SMOKE:-}" ]]; then  # every step of the real script, at a size two CPU cores finish
    json="${LADDER_JSON:-$out/quality.json}"
    rm -f "$json"
    smoke=(--presets llama-1m --smoke --tokens-per-param 0.02 --seq-len 64 --global-batch 8 --compute-dtype bfloat16
           --eval-batches 2)
    rung quality_smoke_1m 600 "${smoke[@]}"
    sparse_rung quality_smoke_1m_sparseloco "${smoke[@]}"
else
    "$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'
    six=(--presets llama-6m --tokens-per-param 10 --global-batch 128 --seq-len 256 --compute-dtype bfloat16
         --eval-batches 32)
    rung quality_6m 215 "${six[@]}"
    sparse_rung quality_6m_sparseloco "${six[@]}"
    if [[ -n "${LADDER_25M:-}" ]]; then
        twenty_five=(--presets llama-25m --tokens-per-param 10 --global-batch 512 --seq-len 256 --compute-dtype bfloat16
                     --eval-batches 32)
        rung quality_25m 300 "${twenty_five[@]}"
        sparse_rung quality_25m_sparseloco "${twenty_five[@]}"
    fi
fi
[[ -f "$json" ]] && { [[ "$json" -ef "$out/quality.json" ]] || cp "$json" "$out/quality.json"; } && cat "$out/quality.json" | "$python" -c \
    'import json, sys; d = json.load(sys.stdin); [print(g) for g in d.get("gaps", [])]'
exit 0
