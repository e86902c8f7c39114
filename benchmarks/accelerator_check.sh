#!/usr/bin/env bash
# One prepared pass over this host's accelerator, in under 9 minutes on one GPU (docs/RESULTS.md,
# "The learner on a GPU"; docs/PARITY.md, "Quality by size"): the learner's throughput and MFU for
# llama 100m and 1b in bf16 (plain jitted loop vs the daemon's training thread with fragment
# traffic), a short run of 2 real daemons sharing the GPU (their /status learner figures, MFU
# included), remat on the whole 1b model at a context of 8,192 (none, dots, full: step time and
# peak device memory), and the quality ladder's first rung (data-parallel vs decoupled at 6.4M
# parameters). Each stage has its own time limit and the next runs whatever happened. The learner
# figures of both sizes end up in OUT/learner.json (with the command, device and jax version), the
# file results/ keeps; the ladder writes benchmarks/results/accelerator/<UTC date>/quality.json.
#
#   benchmarks/accelerator_check.sh [OUT_DIR]      # default: ./accelerator-check
#   ACCEL_CHECK_TINY=1 benchmarks/accelerator_check.sh /tmp/check   # every stage, tiny, on the CPU
#
# Needs JAX for the accelerator (pip install -e '.[cuda12]' or '.[cuda13]') in the python3 used.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-accelerator-check}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print the tail
    local name="$1" limit=$(( $2 * limit_scale )); shift 2
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

# Tiny: the learner stages at a size the CPU runs in seconds (proves the stages and their outputs
# work; the figures mean nothing); the attention stages, which need an accelerator, are left out.
tiny="${ACCEL_CHECK_TINY:-}"
limit_scale=1
if [[ -n "$tiny" ]]; then
    limit_scale="${ACCEL_CHECK_LIMIT_SCALE:-4}"  # a small CPU compiles slower than a GPU steps
    one_b=(--option size=1m --option compute_dtype='"bfloat16"' --vocab-size 256 --seq-len 64 --batch-size 4
           --fragments 4 --period 4 --steps 20 --repeats 2)
    hundred_m=(--option size=1m --option compute_dtype='"bfloat16"' --vocab-size 256 --seq-len 64 --batch-size 4
               --fragments 4 --period 4 --steps 10 --repeats 1)
    sites=(--size 1m --seq-len 64 --batch-size 4 --platform cpu --jax-platforms cpu --duration 10)
    remat=(--size 1m --vocab-size 256 --seq-len 128 --steps 1)
else
    one_b=(--option size=1b --option compute_dtype='"bfloat16"' --vocab-size 128256 --seq-len 2048 --batch-size 8
           --fragments 24 --period 24 --steps 20 --repeats 2)
    hundred_m=(--option size=100m --option compute_dtype='"bfloat16"' --vocab-size 32000 --seq-len 2048
               --batch-size 16 --fragments 24 --period 24 --steps 40 --repeats 2)
    sites=(--size 100m --seq-len 1024 --batch-size 16 --platform gpu --duration 25)
    remat=(--size 1b --vocab-size 128256 --seq-len 8192 --batch-size 1 --steps 2)
fi
started=$SECONDS
if ! stage learner_1b 130 "$python" benchmarks/learner.py "${one_b[@]}" --attention auto --json "$out/learner_1b.json" \
        && (( SECONDS - started < 60 )); then
    stage learner_1b_xla $((130 - (SECONDS - started))) "$python" benchmarks/learner.py "${one_b[@]}" \
        --attention xla --json "$out/learner_1b_xla.json"
fi

stage learner_100m 60 "$python" benchmarks/learner.py "${hundred_m[@]}" --attention auto \
    --json "$out/learner_100m.json"

# Both sizes in one file, as results/accelerator/<UTC date>/learner.json keeps them.
"$python" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("learner_*.json"))}
if runs:
    (out / "learner.json").write_text(json.dumps({"runs": runs}, indent=2))
    for name, run in runs.items():
        for row in run["results"]:
            print(f"{name}: {run['device']} jax {run['jax']}: daemon/plain {row['ratio_median_of_pairs']:.3f} "
                  f"(median of pairs), daemon MFU {row['daemon_mfu_best']}, host_ms_per_step {row['host_ms_per_step']}")
PY

stage two_sites 70 "$python" benchmarks/accelerator_sites.py --sites 2 "${sites[@]}" --json "$out/two_sites.json"

stage remat_8192 50 "$python" benchmarks/remat_model.py "${remat[@]}" --json "$out/remat_8192.json"

# The quality ladder (docs/PARITY.md, "Quality by size"): data-parallel vs decoupled (int4, then the
# sparse recipe if the stage has a minute left) at 6.4M
# parameters, 10 tokens per parameter (the 25.3M rung with LADDER_25M=1, when a run has the time).
# It writes benchmarks/results/accelerator/<UTC date>/quality.json (and OUT/quality_ladder/quality.json);
# carry benchmarks/corpus with the tree so the device trains on the CPU figures' corpus.
if [[ -n "$tiny" ]]; then
    stage quality_ladder 150 env PYTHON="$python" LADDER_SMOKE=1 LADDER_BUDGET_S=$(( 140 * limit_scale )) \
        benchmarks/quality_ladder.sh "$out/quality_ladder"
else
    stage quality_ladder 225 env PYTHON="$python" LADDER_BUDGET_S=215 benchmarks/quality_ladder.sh "$out/quality_ladder"
fi
# Limits on a GPU: 130 + 60 + 70 + 50 + 225 = 535 s, under the 9 minutes one device call may take.
# The attention choices (benchmarks/attention_check.py) and one llama layer's memory by attention
# and remat (benchmarks/attention_memory.py) were measured on the H200 before (docs/RESULTS.md) and
# are left out of this pass; the learner stages fall back to XLA attention if auto fails.
exit 0
