#!/usr/bin/env bash
# One prepared pass over this host's accelerator, in under 8 minutes on one GPU (docs/RESULTS.md,
# "The learner on a GPU"): attention choices against the reference, the learner's throughput and
# MFU for llama 100m and 1b in bf16 (plain jitted loop vs the daemon's training thread with
# fragment traffic), a short run of 2 real daemons sharing the GPU, and one llama layer's memory
# by attention and remat. Each stage has its own time limit and the next runs whatever happened.
#
#   benchmarks/accelerator_check.sh [OUT_DIR]      # default: ./accelerator-check
#
# Needs JAX for the accelerator (pip install -e '.[cuda12]' or '.[cuda13]') in the python3 used.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-accelerator-check}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print the tail
    local name="$1" limit="$2"; shift 2
    local started=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - started)) s"
    return $rc
}

nvidia-smi -L 2>/dev/null || true
"$python" -c 'import jax; print("jax", jax.__version__, jax.devices())'

stage attention_check 60 "$python" benchmarks/attention_check.py

one_b=(--option size=1b --option compute_dtype='"bfloat16"' --vocab-size 128256 --seq-len 2048 --batch-size 8
       --fragments 24 --period 24 --steps 20 --repeats 2)
started=$SECONDS
if ! stage learner_1b 170 "$python" benchmarks/learner.py "${one_b[@]}" --attention auto --json "$out/learner_1b.json" \
        && (( SECONDS - started < 80 )); then
    stage learner_1b_xla $((170 - (SECONDS - started))) "$python" benchmarks/learner.py "${one_b[@]}" \
        --attention xla --json "$out/learner_1b_xla.json"
fi

stage learner_100m 90 "$python" benchmarks/learner.py --option size=100m --option compute_dtype='"bfloat16"' \
    --vocab-size 32000 --seq-len 2048 --batch-size 16 --fragments 24 --period 24 --steps 40 --repeats 2 \
    --attention auto

stage two_sites 150 "$python" benchmarks/accelerator_sites.py --sites 2 --duration 40 --size 100m --seq-len 1024 \
    --batch-size 16 --platform gpu

# The quality ladder (docs/PARITY.md, "Quality by size"): data-parallel vs decoupled at 6.4M and
# 25.3M parameters, 10 tokens per parameter, each rung under its own limit inside the script. It
# writes benchmarks/results/accelerator/<UTC date>/quality.json (and OUT/quality_ladder/quality.json);
# carry benchmarks/corpus with the tree so the device trains on the CPU figures' corpus.
stage quality_ladder 570 env PYTHON="$python" benchmarks/quality_ladder.sh "$out/quality_ladder"

stage attention_memory 50 "$python" benchmarks/attention_memory.py --contexts 2048 8192 \
    --variants xla:none cudnn:none chunked:none chunked:full --time 3
exit 0
