"""Where a replica's and a learner's bytes per parameter go: the replica stack driven in-process.

Drives the parts of a node that hold the model's bytes, without the network: the global state
and its rebase history (`sync/global_state.py`), the replica (`sync/replica.py`), the lease
holder's merge of stale contributions (`sync/merge.py`), the durable log (`daemon/coordination_store.py`)
holding real int4 commit entries, one checkpoint written and read back as compaction does, and
(`learner`) the learner's jitted AdamW model on the CPU. After each phase it records the
process's resident set (VmRSS) and its peak (VmHWM) from /proc/self/status; each role runs in a
child process of its own so its peak is its own.

    python benchmarks/memory.py --model medium --json memory.json     # witness and learner
    python benchmarks/memory.py --model medium --roles witness        # one role
    python benchmarks/memory.py --llama 1b --roles witness --rounds 3 # a 1B-parameter replica
    python benchmarks/memory.py --roles learner --error-feedback topk2  # + the error-feedback remainders

Figures are bytes per model parameter: the global parameters and momentum need 8 (fp32 each),
AdamW's two moments another 8 and the learner's own parameters 4; error feedback (a sparse uplink
codec) adds its float32 remainders, 4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# This checkout's code, not an installed copy's (the child processes run this file again).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start VmHWM afresh from the current RSS (Linux: clear_refs 5), so a later phase's peak is its own."""
    Path("/proc/self/clear_refs").write_text("5")


def _guard_machine(min_available_mib: int) -> None:
    """Exit at once (status 3) if the machine's available memory drops below the floor: the
    1B-parameter run must not push other work on a shared machine into the OOM killer."""
    import threading

    def watch() -> None:
        while True:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:") and int(line.split()[1]) < min_available_mib * 1024:
                    print(f"memory guard: MemAvailable below {min_available_mib} MiB, stopping", flush=True)
                    os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


class Phases:
    """VmRSS and VmHWM after each named phase, in bytes per parameter above the baseline."""

    def __init__(self, params: int) -> None:
        self.params = params
        self.rows: list[dict[str, Any]] = []
        self.baseline_kib = _status_kib("VmRSS")
        self.peak_kib = self.baseline_kib  # the highest VmHWM read, across resets of VmHWM
        self.step_peaks_kib: dict[str, int] = {}  # per kind of step, its own highest peak

    def reset(self) -> None:
        self.peak_kib = max(self.peak_kib, _status_kib("VmHWM"))
        _reset_peak()

    def step_done(self, kind: str) -> None:
        """Record the peak since the last reset as one `kind` step's (e.g. "merge", "apply")."""
        hwm = _status_kib("VmHWM")
        self.peak_kib = max(self.peak_kib, hwm)
        self.step_peaks_kib[kind] = max(self.step_peaks_kib.get(kind, 0), hwm)

    def per_param(self, kib: int) -> float:
        return round((kib - self.baseline_kib) * 1024 / self.params, 2)

    def mark(self, name: str) -> None:
        rss, hwm = _status_kib("VmRSS"), _status_kib("VmHWM")
        self.peak_kib = hwm = max(self.peak_kib, hwm)
        row = {"phase": name, "rss_mib": round(rss / 1024, 1), "peak_mib": round(hwm / 1024, 1),
               "rss_bytes_per_param": round((rss - self.baseline_kib) * 1024 / self.params, 2),
               "peak_bytes_per_param": round((hwm - self.baseline_kib) * 1024 / self.params, 2)}
        self.rows.append(row)
        print(f"  {name:<44} rss {row['rss_mib']:>8.1f} MiB  peak {row['peak_mib']:>8.1f} MiB  "
              f"above baseline: {row['rss_bytes_per_param']:>6.2f} / {row['peak_bytes_per_param']:>6.2f} B/param",
              flush=True)


def _model_spec(args: argparse.Namespace) -> Any:
    from diloco_node.config.manifest import ModelSpec
    if args.llama:
        return ModelSpec.of("llama", vocab_size=args.vocab, seq_len=args.seq_len, size=args.llama)
    return ModelSpec.of("bytes", seq_len=args.seq_len, size=args.model)


def _shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """Parameter shapes without allocating the model (an abstract trace)."""
    from diloco_node.learn import factory, model as model_lib
    _, abstract = factory.abstract_model(spec)
    return model_lib.param_shapes(abstract)


def run_role(args: argparse.Namespace) -> dict[str, Any]:
    """One role in this process: the replica stack, plus the learner's model when asked."""
    from bootstrap.coordinator_node import PersistentState
    from bootstrap.election import ElectionState
    from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
    from bootstrap.replog import LogStore
    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.daemon.history_ring import DiskVersionRings
    from diloco_node.daemon.coordination_store import CoordinationStore
    from diloco_node.ops.checkpoint import CheckpointStore, verify_checkpoint_file
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions
    from diloco_node.sync.replica import CommitPayload, Replica
    from diloco_node.sync.state_codec import FragmentState
    from wire.codecs import decode_named, encode_named

    spec = _model_spec(args)
    shapes = _shapes(spec)
    params = int(sum(np.prod(s) for s in shapes.values()))
    print(f"{args.role}: {params / 1e6:.1f}M parameters, {len(shapes)} tensors, P = {args.fragments}", flush=True)
    rng = np.random.default_rng(0)
    _guard_machine(args.min_available_mib)
    phases = Phases(params)
    phases.mark("baseline (imports, shapes)")
    plan = plan_fragments(shapes, args.fragments, max(args.fragments, 8), 0)
    # Built from zeros (pages the kernel maps lazily), then each fragment installed with random
    # values one at a time: a 1B-parameter state never exists twice in this process.
    replica = Replica(plan, {n: np.zeros(s, np.float32) for n, s in shapes.items()}, OuterOptimizer())
    for fragment in plan.fragments:
        values = {}
        for name in fragment.names:
            values[name] = rng.standard_normal(shapes[name], dtype=np.float32)
            values[name] *= 0.02
        zeros = {name: np.zeros(shapes[name], np.float32) for name in fragment.names}
        replica.state.install_fragment(FragmentState(fragment.index, 0, values, zeros))
        del values, zeros
    tmp = tempfile.TemporaryDirectory(prefix="dn-memory-")
    version_rings = DiskVersionRings(Path(tmp.name) / "history-ring")
    if not args.history_in_memory:
        replica.state.use_history(version_rings)  # as the daemon does (node.py)
    phases.mark("replica built (global state)")
    learner = None
    error_feedback_bytes = 0
    if args.role == "learner":
        from diloco_node.config.manifest import InnerOptimizer
        from diloco_node.learn.inner import InnerLearner
        learner = InnerLearner(spec, InnerOptimizer(batch_size=args.batch), 0)
        tokens = rng.integers(0, 256, (args.batch, spec.seq_len + 1), dtype=np.int32)
        for _ in range(2):
            learner.step(tokens[:, :-1], tokens[:, 1:]).block_until_ready()
        phases.mark("learner built, 2 AdamW steps")
        if args.error_feedback:
            # The learner's error-feedback remainders (learn/error_feedback.py): one send of every
            # fragment with a random delta leaves a float32 remainder for every parameter.
            from diloco_node.learn.error_feedback import ErrorFeedback, codec_quantizer
            feedback = ErrorFeedback(1.0, codec_quantizer(args.error_feedback))
            for fragment in plan.fragments:
                delta = {}
                for name in fragment.names:
                    delta[name] = rng.standard_normal(shapes[name], dtype=np.float32)
                    delta[name] *= 1e-3
                feedback.compensate(fragment.index, delta)
                del delta
            error_feedback_bytes = feedback.nbytes()
            phases.mark(f"error feedback remainders ({args.error_feedback}), one send of every fragment")
    # From here on the steady state: the start-up's peak (the initial parameters beside their
    # validated copies) is reported above and not counted in what follows.
    start_peak = phases.rows[-1]["peak_bytes_per_param"]
    _reset_peak()
    phases.peak_kib = phases.baseline_kib

    with tmp:
        store = CoordinationStore(Path(tmp.name) / "coordination")
        persistent = PersistentState(ElectionState(1, "a"), LogStore(Snapshot(0, 0, ClusterConfig()), []))
        caps = ContributionCaps(max_tokens_per_step=1 << 20, max_steps=1 << 20)
        index = 0
        for round_ in range(1, args.rounds + 1):
            for fragment in plan.fragments:
                p = fragment.index
                fshapes = {n: shapes[n] for n in fragment.names}
                # The state's own read-only arrays, as the syncer's merge reads them (no copy).
                current = replica.state.fragment_params(p, copies=False)
                # Two learners, one on the current round and one a round or two behind: a stale
                # contribution is rebased from the history.
                phases.reset()  # the lease holder's part: merge, encode, digest preview
                contributions = []
                for learner_id, lag in (("a", 0), ("b", min(2, replica.state.round(p)))):
                    delta = {n: rng.standard_normal(s, dtype=np.float32) for n, s in fshapes.items()}
                    for values in delta.values():  # scaled in place: the inputs cost one copy each
                        values *= 1e-3
                    contributions.append(Contribution(learner_id, p, replica.state.round(p) - lag, delta, 8, 8 * 512))
                result = merge_contributions(contributions, current, replica.state.history(p), caps=caps,
                                             embedding_names=())
                del contributions, current
                encoded = encode_named(result.outer_gradient, "int4")
                digest = replica.digest_after(p, decode_named(encoded))
                payload = CommitPayload(encoded, ("a", "b"), (1.0, 1.0)).encode()
                index += 1
                entry = LogEntry(1, index, EntryKind.OUTER_COMMIT, payload, fragment=p,
                                 round=replica.state.round(p) + 1, digest=digest)
                persistent.log.entries.append(entry)
                del entry, payload, encoded, result
                phases.step_done("merge")
                phases.reset()  # every replica's part: append to the log, apply
                store.sync(persistent)
                outcome = replica.apply(persistent.log.entries[-1])
                assert outcome.applied and not outcome.diverged, outcome.reason
                phases.step_done("apply")
            if round_ in (1, args.rounds) or round_ % 4 == 0:
                phases.mark(f"round {round_}: {index} commits in the log")
        log_bytes = store.log_bytes
        checkpoints = CheckpointStore(Path(tmp.name) / "checkpoints", keep=2)
        meta, arrays = replica.checkpoint_entries()
        path = checkpoints.save({"applied_index": index, **meta}, arrays)
        del meta, arrays
        phases.mark("checkpoint written")
        verify_checkpoint_file(path)
        phases.mark("checkpoint verified (compaction's check)")
        store.close()
        version_rings.close()
    return {"role": args.role, "history": "memory" if args.history_in_memory else "disk", "model": args.llama or args.model, "params": params, "fragments": args.fragments,
            "rounds": args.rounds, "commits": index, "log_bytes": log_bytes,
            "log_bytes_per_param": round(log_bytes / params, 2), "phases": phases.rows,
            "peak_bytes_per_param": phases.rows[-1]["peak_bytes_per_param"], "start_up_peak_bytes_per_param": start_peak,
            "peak_mib": round(phases.peak_kib / 1024, 1),
            "step_peak_bytes_per_param": {k: phases.per_param(v) for k, v in phases.step_peaks_kib.items()},
            "step_peak_mib": {k: round(v / 1024, 1) for k, v in phases.step_peaks_kib.items()},
            "rss_bytes_per_param": phases.rows[-1]["rss_bytes_per_param"],
            "baseline_mib": round(phases.baseline_kib / 1024, 1),
            "error_feedback_bytes_per_param": round(error_feedback_bytes / params, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="medium", help="bytes model size (tiny, small, medium)")
    parser.add_argument("--llama", default="", help="a llama preset instead (learn/llama.py LLAMA_PRESETS)")
    parser.add_argument("--vocab", type=int, default=32000, help="llama vocabulary size")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10, help="commits per fragment (history fills at 8)")
    parser.add_argument("--batch", type=int, default=4, help="learner batch size")
    parser.add_argument("--roles", default="witness,learner")
    parser.add_argument("--error-feedback", default="", metavar="CODEC",
                        help="learner: also hold error-feedback remainders for this uplink codec (e.g. topk2)")
    parser.add_argument("--role", default="", help=argparse.SUPPRESS)  # the child's own role
    parser.add_argument("--history-in-memory", action="store_true",
                        help="keep the rebase history in memory (the in-process runner's way), not on disk")
    parser.add_argument("--min-available-mib", type=int, default=3072,
                        help="stop if the machine's available memory drops below this (shared machines)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.role:
        print("RESULT " + json.dumps(run_role(args)), flush=True)
        return 0
    results = []
    for role in args.roles.split(","):
        child = [a for a in (argv if argv is not None else sys.argv[1:])]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, __file__, *child, "--role", role], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
        result["seconds"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(f"{role}: peak {result['peak_bytes_per_param']} bytes per parameter above the baseline "
              f"({result['baseline_mib']} MiB) while committing (start-up {result['start_up_peak_bytes_per_param']}), "
              f"resident at the end {result['rss_bytes_per_param']}; log {result['log_bytes_per_param']} B/param "
              f"on disk; peak of one step: {result['step_peak_bytes_per_param']} B/param, "
              f"{result['step_peak_mib']} MiB; error-feedback remainders held "
              f"{result['error_feedback_bytes_per_param']} B/param", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
