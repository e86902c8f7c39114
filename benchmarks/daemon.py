"""Daemon benchmarks with real `diloco-node run` processes on loopback.

1. Failover: SIGKILL the coordinator of a 3-site run, time until a survivor reports a new
   coordinator AND a commit past the last one seen (polled every 50 ms), restart the victim from
   its checkpoint, repeat; p50/p99 over --trials (>= 10).
2. Join: a site joins through a link emulator at --bandwidth-mbit, twice: with the shared warm
   JAX compilation cache, and with an empty one (a host that never ran the model). Measured from
   process spawn to its first training step (/status learner step > 0) and to /readyz ready
   (replica caught up with the log), plus the node's own start-up timeline from its log; the
   target is training within state size / link bandwidth + 10 s.
3. Learner step time, as batch tokens / tokens-per-second from /status (30 s window, so it
   includes whatever the node does beside): in-process jitted step alone; a 1-site run (no peers;
   it syncs with itself), then the same site a syncing with peers that do not compete for the CPU (2 witnesses:
   the step-time target), then with 2 more learners paced to 1 step/s (3 learners merged, little
   extra CPU); and site a of the 3-site run whose other learners run at 10 steps/s
   (CPU-contended: three JAX processes on the same cores, not a measure of sync overhead).

    python benchmarks/daemon.py --json out.json [--trials 10]

Numbers depend on the machine and its load; run it alone and report the load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, LinkShape, Site
from diloco_node.testbed.local_cluster import Cluster

STARTUP_S = 240.0
BATCH_TOKENS = 4 * 32  # DEFAULT_SETTINGS: batch 4 x seq 32


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
    from diloco_node.config.settings import load_config
    from diloco_node.learn import data as data_lib
    from diloco_node.learn.inner import InnerLearner

    overrides = dict(setting.split("=", 1) for setting in DEFAULT_SETTINGS if setting.startswith(("run.", "data.")))
    config = load_config(None, {}, overrides)
    manifest = config.run
    corpus = data_lib.open_site_data(config.node.data, None)
    learner = InnerLearner(manifest.model, manifest.inner, manifest.seed)
    sampler = data_lib.BatchSampler(corpus.train, manifest.inner.batch_size, manifest.model.seq_len, 0)
    for _ in range(5):
        float(learner.step(*sampler.next()))
    started = time.perf_counter()
    for _ in range(steps):
        float(learner.step(*sampler.next()))
    return (time.perf_counter() - started) / steps


def learner_clock(site: Site) -> tuple[int, float, float]:
    """(steps, compute seconds, sync seconds) of a site's training thread, from /status and /metrics."""
    doc = site.status()
    with urllib.request.urlopen(site.url + "/metrics", timeout=2.0) as response:
        text = response.read().decode()
    values = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^diloco_learner_(compute|sync)_seconds_total(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.MULTILINE)}
    return doc["learner"]["step"], values.get("compute", 0.0), values.get("sync", 0.0)


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU time (user + system) each running site's process has used so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for node_id, site in cluster.sites.items():
        if site.pid is not None:
            try:
                fields = Path(f"/proc/{site.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[node_id] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def measure_step(cluster: Cluster, name: str, label: str, window_s: float = 35.0) -> dict:
    """Wall-clock step time (tokens/s window), the training thread's own split over the window,
    the CPU our site processes used (cores) and the machine's load average (others' jobs too)."""
    site = cluster.sites[name]
    steps0, compute0, sync0 = learner_clock(site)
    cpu0, started = cpu_seconds(cluster), time.monotonic()
    time.sleep(window_s)  # a full tokens/s window
    wall = step_time_from(cluster.poll()[name])
    steps1, compute1, sync1 = learner_clock(site)
    cpu1, elapsed = cpu_seconds(cluster), time.monotonic() - started
    steps = max(1, steps1 - steps0)
    out = {"step_s": wall, "compute_s_per_step": (compute1 - compute0) / steps,
           "learner_sync_s_per_step": (sync1 - sync0) / steps, "steps": steps1 - steps0,
           "cores_used": {n: round((cpu1[n] - cpu0[n]) / elapsed, 3) for n in cpu1 if n in cpu0},
           "load_average_1m": load_average()}
    print(f"{label}: wall {wall * 1000 if wall else float('nan'):.2f} ms/step, in-thread compute "
          f"{out['compute_s_per_step'] * 1000:.2f} ms + sync {out['learner_sync_s_per_step'] * 1000:.3f} ms; "
          f"cores used {out['cores_used']}, load {out['load_average_1m']}", flush=True)
    return out


def pin(site: Site, cores: set[int] | None) -> None:
    """Bind a freshly spawned site to `cores` (before its interpreter starts threads, which inherit)."""
    if cores is not None and site.pid is not None:
        os.sched_setaffinity(site.pid, cores)


def bench_isolated_sync(root: Path, settings: tuple[str, ...] = DEFAULT_SETTINGS, pin_cores: bool = False) -> dict:
    """Site a alone (no peers), then syncing with peers that leave the CPU to it: 2 witnesses, then
    2 slow learners too; back to back in one run, so machine load drifts as little as possible.
    `pin_cores`: site a on core 0 and every peer on core 1, so the peers' own work cannot slow
    site a's XLA threads and what remains is site a's own cost of syncing."""
    own, others = ({0}, {1}) if pin_cores else (None, None)
    out: dict = {"pinned_cores": pin_cores}
    with Cluster.create(root) as cluster:
        a = cluster.add("a", env={"DILOCO_X_MIN_STEP_S": "0"}, settings=settings)
        pin(a, own)
        wait_ready(cluster, {"a"})
        out["step_single_site"] = measure_step(cluster, "a", "single-site daemon (no peers)")
        for w in ("w1", "w2"):
            pin(cluster.add(w, bootstrap=a, role="witness", settings=settings), others)
        wait_ready(cluster, {"a", "w1", "w2"})
        cluster.wait_for("3 voters", lambda s: len(s["a"].get("members", [])) == 3
                         and all(m.get("voter") for m in s["a"]["members"]), 60)
        out["step_with_2_witnesses"] = measure_step(cluster, "a", "site a + 2 witnesses")
        slow = {"DILOCO_X_MIN_STEP_S": "1.0"}
        pin(cluster.add("s1", bootstrap=a, env=slow, settings=settings), others)
        pin(cluster.add("s2", bootstrap=a, env=slow, settings=settings), others)
        wait_ready(cluster, {"a", "s1", "s2"})
        out["step_with_2_witnesses_2_slow_learners"] = measure_step(cluster, "a",
                                                                      "site a + 2 witnesses + 2 learners at 1 step/s")
        out["commit_index_end"] = cluster.poll()["a"]["commit_index"]
    return out


TIMELINE = re.compile(r"(listening on|identity at|state built at|state downloaded at|training step compiled in"
                      r"|training started at|ready,).*?([0-9.]+) s after process start")


def timeline_from_log(text: str) -> dict[str, float]:
    """The node's own start-up phases (seconds after its process started), last start only."""
    text = text.rsplit("===== start", 1)[-1]
    return {m.group(1).rstrip(" ,").replace(" at", "").replace(" in", ""): float(m.group(2))
            for m in TIMELINE.finditer(text)}


def bench_join(cluster: Cluster, name: str, bootstrap: str, bandwidth_mbit: float, env: dict[str, str]) -> dict:
    started = time.monotonic()
    site = cluster.add(name, bootstrap=bootstrap, env=env)
    training_s = ready_s = None
    while time.monotonic() - started < STARTUP_S and (training_s is None or ready_s is None):
        doc = site.status(timeout=1.0)
        if doc is not None:
            if training_s is None and doc["learner"]["step"] > 0:
                training_s = time.monotonic() - started
            if ready_s is None and doc.get("ready"):
                ready_s = time.monotonic() - started
        time.sleep(0.05)
    text = site.log_text()
    match = re.search(r"downloaded the global state \((\d+) bytes\) in ([0-9.]+) s", text)
    state_bytes = int(match.group(1)) if match else None
    bound = (state_bytes * 8 / (bandwidth_mbit * 1e6) + 10.0) if state_bytes else None
    result = {"spawn_to_training_s": training_s, "spawn_to_ready_s": ready_s,
              "download_s": float(match.group(2)) if match else None, "state_bytes": state_bytes,
              "bound_s": bound, "training_within_bound": None not in (training_s, bound) and training_s <= bound,
              "timeline_s": timeline_from_log(text)}
    print(f"join {name}: {result}", flush=True)
    return result


def wait_ready(cluster: Cluster, names: set[str]) -> dict:
    return cluster.wait_for(f"{sorted(names)} ready", lambda s: names <= {n for n, d in s.items() if d.get("ready")},
                            STARTUP_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0)
    parser.add_argument("--latency-ms", type=float, default=30.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set_values",
                        help="run setting for the step-time sites, after the test defaults (e.g. "
                             "run.sync.period=32: the defaults sync every 8 steps, far more often than a real run)")
    parser.add_argument("--step-only", action="store_true", help="only the step-time measurements (~3 minutes)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="step time: site a on core 0, its peers on core 1 (needs >= 2 cores)")
    args = parser.parse_args()
    results: dict = {"machine_note": "2 cores shared with other jobs; figures include that contention"}

    results["step_s_inprocess"] = bench_inprocess_step()
    print(f"in-process step: {results['step_s_inprocess'] * 1000:.1f} ms", flush=True)

    root = Path(tempfile.mkdtemp(prefix="diloco-bench-"))
    step_settings = (*DEFAULT_SETTINGS, *args.set_values)
    results["step_settings"] = list(step_settings)
    results.update(bench_isolated_sync(root / "isolated", step_settings, args.pin_cores))
    alone, synced = results.get("step_single_site", {}), results.get("step_with_2_witnesses", {})
    if alone.get("step_s") and synced.get("step_s"):
        results["sync_overhead_vs_no_peers"] = {
            "wall": synced["step_s"] / alone["step_s"] - 1.0,
            "training_thread": (synced["compute_s_per_step"] + synced["learner_sync_s_per_step"])
            / (alone["compute_s_per_step"] + alone["learner_sync_s_per_step"]) - 1.0,
            "target": 0.1}
    if args.step_only:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(results.get("sync_overhead_vs_no_peers")), flush=True)
        return 0
    with Cluster.create(root / "main") as cluster:
        unpaced = {"DILOCO_X_MIN_STEP_S": "0"}
        a = cluster.add("a", env=unpaced)
        wait_ready(cluster, {"a"})
        paced = {"DILOCO_X_MIN_STEP_S": "0.1"}
        cluster.add("b", bootstrap=a, env=paced)
        cluster.add("c", bootstrap=a, env=paced)
        wait_ready(cluster, {"a", "b", "c"})
        results["step_three_sites_cpu_contended"] = measure_step(cluster, "a",
                                                                   "3-site run, site a (CPU-contended)")

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
            cluster.wait_for("next commit", lambda s, survivors=survivors, leader=leader, before=before: len(
                {s[n].get("coordinator") for n in survivors if n in s} - {None, leader}) == 1
                and max(s[n]["commit_index"] for n in survivors if n in s) > before, 120, interval=0.05)
            failovers.append(time.monotonic() - killed)
            print(f"failover trial {trial}: {failovers[-1]:.2f} s", flush=True)
            victim.start()
            wait_ready(cluster, {"a", "b", "c"})
        results["failover_s"] = {"trials": failovers, "p50": percentile(failovers, 0.5),
                                 "p99": percentile(failovers, 0.99)}

        # Join through an emulated WAN link in front of site a.
        link = LinkShape(bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms)
        bootstrap = cluster.link_to("a", link)
        results["log_entries_at_join"] = max(d["commit_index"] for d in cluster.poll().values())
        results["join_warm_cache"] = bench_join(cluster, "d", bootstrap, args.bandwidth_mbit, {})
        cold = str(root / "cold-jax-cache")
        results["join_cold_cache"] = bench_join(cluster, "e", bootstrap, args.bandwidth_mbit,
                                                {"JAX_COMPILATION_CACHE_DIR": cold})
        results["join_link"] = {"bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms}
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
