"""Daemon benchmarks with real `diloco-node run` processes on loopback.

1. Failover: SIGKILL the coordinator of a 3-site run, time until a survivor reports a new
   coordinator AND a commit past the last one seen (polled every 50 ms), restart the victim from
   its checkpoint, repeat; p50/p99 over --trials (>= 10).
2. Join: a fourth site joins through a link emulator at --bandwidth-mbit; time from process start
   to ready, and the state download alone (from the node's log), against
   state size / link bandwidth + 10 s.
3. Learner step time: in-process jitted step alone; a 1-site run (it syncs with itself); site a
   of the 3-site run (the two other learners paced to 10 steps/s). Measured as batch tokens /
   tokens-per-second from /status (30 s window), so it includes whatever the node does beside.

    python benchmarks/daemon.py --json out.json [--trials 10]

Numbers depend on the machine and its load; run it alone and report the load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_node.daemon.local_cluster import DEFAULT_RUN_FLAGS, Cluster, child_env, free_port  # noqa: E402

STARTUP_S = 240.0
BATCH_TOKENS = 4 * 32  # DEFAULT_RUN_FLAGS: batch 4 x seq 32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def step_time_from(doc: dict) -> float | None:
    rate = doc["learner"]["tokens_per_s"]
    return BATCH_TOKENS / rate if rate > 0 else None


def bench_inprocess_step(steps: int = 200) -> float:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    from diloco_node import data as data_lib
    from diloco_node import model as model_lib
    from diloco_node.config import load_config
    from diloco_node.inner import InnerLearner

    flags = {DEFAULT_RUN_FLAGS[i + 1].split("=")[0]: DEFAULT_RUN_FLAGS[i + 1].split("=")[1]
             for i in range(0, len(DEFAULT_RUN_FLAGS), 2) if DEFAULT_RUN_FLAGS[i + 1].startswith("run.")}
    manifest = load_config(None, {}, flags).run
    corpus = data_lib.load_corpus(manifest.data)
    cfg = model_lib.model_config(manifest.model.size, manifest.model.seq_len)
    learner = InnerLearner(cfg, manifest.inner, manifest.seed)
    sampler = data_lib.BatchSampler(corpus.train, manifest.inner.batch_size, manifest.model.seq_len, 0)
    for _ in range(5):
        float(learner.step(*sampler.next()))
    started = time.perf_counter()
    for _ in range(steps):
        float(learner.step(*sampler.next()))
    return (time.perf_counter() - started) / steps


def wait_ready(cluster: Cluster, names: set[str]) -> dict:
    return cluster.wait_for(f"{sorted(names)} ready", lambda s: names <= {n for n, d in s.items() if d.get("ready")},
                            STARTUP_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=30.0)
    args = parser.parse_args()
    results: dict = {"machine_note": "2 cores shared with other jobs; figures include that contention"}

    results["step_s_inprocess"] = bench_inprocess_step()
    print(f"in-process step: {results['step_s_inprocess'] * 1000:.1f} ms", flush=True)

    root = Path(tempfile.mkdtemp(prefix="diloco-bench-"))
    cluster = Cluster.create(root)
    link: subprocess.Popen[bytes] | None = None
    try:
        unpaced = {"DILOCO_X_MIN_STEP_S": "0"}
        a = cluster.add("a", env=unpaced)
        wait_ready(cluster, {"a"})
        time.sleep(35)  # a full tokens/s window
        results["step_s_single_site"] = step_time_from(cluster.poll()["a"])
        print(f"single-site daemon step: {results['step_s_single_site']}", flush=True)

        paced = {"DILOCO_X_MIN_STEP_S": "0.1"}
        cluster.add("b", bootstrap=a, env=paced)
        cluster.add("c", bootstrap=a, env=paced)
        wait_ready(cluster, {"a", "b", "c"})
        time.sleep(35)
        results["step_s_three_sites"] = step_time_from(cluster.poll()["a"])
        print(f"3-site daemon step (site a): {results['step_s_three_sites']}", flush=True)

        failovers: list[float] = []
        for trial in range(args.trials):
            statuses = cluster.poll()
            leader = cluster.coordinator(statuses)
            if leader is None:
                time.sleep(1)
                continue
            before = max(d["commit_index"] for d in statuses.values())
            victim = cluster.sites[leader]
            victim.kill()
            killed = time.monotonic()
            survivors = [n for n in ("a", "b", "c") if n != leader]
            cluster.wait_for("next commit", lambda s: len({s[n].get("coordinator") for n in survivors if n in s}
                                                          - {None, leader}) == 1
                             and max(s[n]["commit_index"] for n in survivors if n in s) > before, 120,
                             interval=0.05)
            failovers.append(time.monotonic() - killed)
            print(f"failover trial {trial}: {failovers[-1]:.2f} s", flush=True)
            victim.start()
            wait_ready(cluster, {"a", "b", "c"})
        results["failover_s"] = {"trials": failovers, "p50": percentile(failovers, 0.5),
                                 "p99": percentile(failovers, 0.99)}

        # Join through an emulated WAN link in front of site a.
        public = free_port()
        link = subprocess.Popen([sys.executable, "-m", "diloco_node.linkemu", "--listen", f"127.0.0.1:{public}",
                                 "--upstream", cluster.sites["a"].address, "--bandwidth-mbit", str(args.bandwidth_mbit),
                                 "--latency-ms", str(args.latency_ms)], env=child_env(), stdout=subprocess.DEVNULL)
        time.sleep(1.0)
        started = time.monotonic()
        d = cluster.add("d", extra=["--bootstrap", f"127.0.0.1:{public}"])
        wait_ready(cluster, {"d"})
        join_total = time.monotonic() - started
        match = re.search(r"downloaded the global state \((\d+) bytes\) in ([0-9.]+) s", d.log_text())
        state_bytes = int(match.group(1)) if match else None
        download_s = float(match.group(2)) if match else None
        bound = (state_bytes * 8 / (args.bandwidth_mbit * 1e6) + 10.0) if state_bytes else None
        results["join"] = {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms,
                           "total_to_ready_s": join_total, "download_s": download_s, "state_bytes": state_bytes,
                           "bound_s": bound, "download_within_bound": download_s is not None and bound is not None
                           and download_s <= bound}
        print(f"join: {results['join']}", flush=True)
    finally:
        cluster.close()
        if link is not None:
            link.kill()
            link.wait(10)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
