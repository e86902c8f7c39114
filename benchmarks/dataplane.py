"""Data-plane benchmark: real daemons with the synthetic learner, no training compute.

Every site is a real `diloco-node run` process behind its own link emulator (the launcher's
`LinkShape`: bandwidth and latency on traffic INTO the site, both directions of each
connection). Learner sites run `[node] learner = "synthetic"` (learn/synthetic_learner.py):
random fp32 deltas of the model's shapes at a set step rate, on the fragment schedule. The
codecs, the transport, the merge, the replicated log and the replicas are the real ones.
Nothing is checkpointed during a run (checkpoint_interval_s is set past its end), so the log
is not compacted: the on-disk log's growth per commit is the size of one commit entry.

Measured per run, over a window of --duration seconds after every site is ready:
- commits: fragment commits (outer_commit entries) the lease holder committed in the window;
- coordinator_egress_per_commit_over_delta: bytes the holder sent (its /status byte counter)
  per commit, divided by the encoded delta (the log's growth per commit on the holder);
  without relays the holder sends each commit to every other site, so expect about sites - 1;
  with `--fanout F` (the sites' `[node] relay_fanout`) about min(F, sites - 1);
- commit_to_applied_s {p50, p99}: from the holder's `commit` event to each other site's
  `apply` event of the same entry (history.jsonl, wall clock of the one machine);
- peak_rss_mb {node: MiB}: VmHWM of each daemon process (/proc/<pid>/status) at the end,
  its peak since start (so it includes start-up: model init, the state download);
- rss_bytes_per_param {node: bytes}: the same per model parameter;
- state_mb: global parameters + momentum (8 bytes a parameter);
- link_utilization: bytes the holder sent / (link rate x window x (sites - 1)), since its
  commits leave through sites - 1 emulated links (min(fanout, sites - 1) with relays), and each site's own bytes in and out / (link
  rate x window);
- syncer_stages_cpu_s_per_GB: the lease holder's side of a round stage by stage (frames, hash,
  int4 decode, merge, codec_down), CPU-seconds per GB of fp32 values, each stage timed alone in
  this process before the runs (benchmarks/contribution_stages.py; `--stages` prints only these);
- relays {node: counts}: each site's relay counters over the window (/status `relays`): copies
  pushed as the tree's root, forwarded, fetch answers served, fetches sent, and their bytes;
  the holder's `served` says how often a site had to climb to it for a payload.

    python benchmarks/dataplane.py --json out.json [--preset baseline | --quick]
    python benchmarks/dataplane.py --json out.json --params 100m --sites 4 --duration 60
    python benchmarks/dataplane.py --json out.json --stages

Figures depend on the machine and its load; the JSON records the load average. Peak RSS does
not depend on load. `--fanout F` turns relayed commits on (docs/OPERATIONS.md "Relayed commits")
for the runs given by flags, or for every run of a preset.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_node.daemon.memory_bound import issue_target_bytes, memory_bound
from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.launcher import LinkShape
from diloco_node.testbed.local_cluster import Cluster
from wire.limits import MiB

# [run.model] per size: the llama presets (learn/llama.py) at their usual vocabularies.
MODELS = {
    "1m": {"run.model.factory": "llama", "run.model.size": "1m", "run.model.vocab_size": "256"},
    "10m": {"run.model.factory": "llama", "run.model.size": "10m", "run.model.vocab_size": "32000"},
    "100m": {"run.model.factory": "llama", "run.model.size": "100m", "run.model.vocab_size": "32000"},
    "1b": {"run.model.factory": "llama", "run.model.size": "1b", "run.model.vocab_size": "128256"},
}
# The machine is shared: a run stops (and says so) when the memory left to everyone falls below this.
MIN_AVAILABLE_MB = 2048


class OutOfMemory(RuntimeError):
    """The machine's available memory fell below MIN_AVAILABLE_MB during a run."""


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return math.inf


@dataclass(frozen=True)
class RunSpec:
    params: str  # a key of MODELS
    sites: int  # every daemon, witnesses included
    witnesses: int = 1
    fragments: int = 4
    period: int = 40  # a fragment is due every `period` synthetic steps
    steps_per_s: float = 2.0
    duration_s: float = 60.0
    link_mbit: float = 1000.0
    latency_ms: float = 10.0
    fanout: int = 0  # [node] relay_fanout of every site (0: no relays, the holder sends to all)
    vocab_size: int | None = None  # None: the preset's usual vocabulary (MODELS)

    def model_settings(self) -> dict[str, str]:
        model = dict(MODELS[self.params])
        if self.vocab_size is not None:
            model["run.model.vocab_size"] = str(self.vocab_size)
        return model


PRESETS: dict[str, list[RunSpec]] = {
    # The issue's runs that exist without relays: 100M at M = 4 and 8, 1B at M = 2 (no witness:
    # two learners, the memory of one machine).
    "baseline": [RunSpec("100m", 4), RunSpec("100m", 8), RunSpec("1b", 2, witnesses=0, fragments=8, period=80)],
    # What fits a 2-core, 24 GiB machine shared with other jobs today (docs/SCALE.md): the fan-out
    # at M = 4 and 8 on a 14.5M model, and 100M parameters at M = 2 (a witness and a learner).
    "small": [RunSpec("10m", 4, steps_per_s=5.0), RunSpec("10m", 8, steps_per_s=5.0), RunSpec("100m", 2)],
    "quick": [RunSpec("1m", 3, fragments=2, period=8, steps_per_s=20.0, duration_s=10.0, link_mbit=100.0,
                      latency_ms=2.0)],
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def peak_rss_bytes(pid: int | None) -> int | None:
    """VmHWM (the process's peak resident set) in bytes, or None if it cannot be read."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_sample(pid: int) -> tuple[int, int, int, float] | None:
    """(VmRSS, RssAnon, RssFile in bytes, CPU-seconds user + system) of a process, or None if gone."""
    try:
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = stat[stat.rindex(")") + 2:].split()
        cpu = (int(ticks[11]) + int(ticks[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15
        return fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0), cpu
    except (OSError, ValueError, IndexError):
        return None


class RssSampler:
    """Samples every watched process's resident set and CPU time every `interval_s` in a thread,
    tagging each sample with the phase `mark` last named: where a peak comes from (start-up, the
    state download, the first commits) and what each phase cost in CPU, per process."""

    def __init__(self, interval_s: float = 0.1) -> None:
        import threading

        self.interval_s = interval_s
        self.pids: dict[str, int] = {}  # name -> pid (daemons, and link emulators as "link:<site>")
        self.samples: list[tuple[float, str, str, int, int, int, float]] = []  # t, phase, name, rss, anon, file, cpu
        self.marks: list[tuple[float, str]] = [(0.0, "start-up")]
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def watch(self, name: str, pid: int | None) -> None:
        if pid is not None:
            self.pids[name] = pid

    def mark(self, phase: str) -> None:
        self.marks.append((round(time.monotonic() - self._t0, 2), phase))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t = round(time.monotonic() - self._t0, 2)
            phase = self.marks[-1][1]
            for name, pid in list(self.pids.items()):
                sample = process_sample(pid)
                if sample is not None:
                    self.samples.append((t, phase, name, *sample))

    def report(self, every_s: float = 5.0) -> dict:
        """Per process: the peak (when, in which phase, anonymous and file-backed parts), the peak
        and CPU-seconds of every phase, and a timeline thinned to one sample per `every_s`."""
        out: dict = {"marks": self.marks, "interval_s": self.interval_s, "processes": {}}
        for name in self.pids:
            rows = [r for r in self.samples if r[2] == name]
            if not rows:
                continue
            peak = max(rows, key=lambda r: r[3])
            phases: dict[str, dict] = {}
            for r in rows:
                ph = phases.setdefault(r[1], {"peak_rss_mb": 0.0, "cpu_s_first": r[6], "cpu_s_last": r[6],
                                              "t_first": r[0], "t_last": r[0]})
                ph["peak_rss_mb"] = max(ph["peak_rss_mb"], round(r[3] / MiB, 1))
                ph["cpu_s_last"], ph["t_last"] = r[6], r[0]
            timeline, next_t = [], 0.0
            for r in rows:
                if r[0] >= next_t or r is peak:
                    timeline.append([r[0], round(r[3] / MiB), round(r[4] / MiB)])
                    next_t = r[0] + every_s
            out["processes"][name] = {
                "peak": {"t": peak[0], "phase": peak[1], "rss_mb": round(peak[3] / MiB, 1),
                         "anon_mb": round(peak[4] / MiB, 1), "file_mb": round(peak[5] / MiB, 1)},
                "phases": {ph: {"peak_rss_mb": v["peak_rss_mb"], "seconds": round(v["t_last"] - v["t_first"], 1),
                                "cpu_s": round(v["cpu_s_last"] - v["cpu_s_first"], 2)} for ph, v in phases.items()},
                "cpu_s_total": round(rows[-1][6], 2),
                "timeline_mb": timeline}
        return out


def rss_table(report: dict) -> str:
    """The sampler's report as a compact text table: one row per process and phase."""
    lines = [f"{'process':<10} {'phase':<28} {'peak RSS MiB':>12} {'seconds':>8} {'CPU-s':>7}"]
    for name, proc in report["processes"].items():
        for phase, v in proc["phases"].items():
            lines.append(f"{name:<10} {phase:<28} {v['peak_rss_mb']:>12.0f} {v['seconds']:>8.1f} {v['cpu_s']:>7.2f}")
        pk = proc["peak"]
        lines.append(f"{name:<10} PEAK at {pk['t']:.1f} s in {pk['phase']!r}: {pk['rss_mb']:.0f} MiB "
                     f"(anon {pk['anon_mb']:.0f}, file {pk['file_mb']:.0f})")
    return "\n".join(lines)


def param_count(spec: RunSpec) -> tuple[int, int]:
    """(parameters, parameters of the largest fragment) of the run's model and plan, from its
    abstract shapes (nothing allocated)."""
    from diloco_node.config.settings import load_config
    from diloco_node.learn import factory
    from diloco_node.learn.model import param_shapes
    from diloco_node.sync.fragments import plan_fragments

    manifest = load_config(None, {}, {**spec.model_settings(), "run.model.seq_len": "256"}).run
    _, state = factory.abstract_model(manifest.model)
    shapes = param_shapes(state)
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    plan = plan_fragments(shapes, spec.fragments, spec.period, 1)
    return sum(sizes.values()), max(sum(sizes[n] for n in f.names) for f in plan.fragments)


def settings_for(spec: RunSpec) -> tuple[str, ...]:
    model = [f"{k}={v}" for k, v in spec.model_settings().items()]
    return (*model, "run.model.seq_len=256", "run.inner.batch_size=8",
            f"run.sync.fragments={spec.fragments}", f"run.sync.period={spec.period}",
            "learner=synthetic", f"synthetic_steps_per_s={spec.steps_per_s}",
            # no checkpoint (and so no compaction) inside the window; no evaluation
            "checkpoint_interval_s=36000", "eval_interval_commits=0",
            # a loaded machine stalls event loops for seconds while big frames are hashed:
            # leases long enough that the holder does not change during a run
            "heartbeat_interval_s=3.0", "lease_timeout_s=30.0", f"relay_fanout={spec.fanout}")


def guarded(check):
    """`check` for Cluster.wait_for, that first stops the run if the machine runs short of memory."""
    def wrapped(statuses: dict) -> bool:
        if available_mb() < MIN_AVAILABLE_MB:
            raise OutOfMemory(f"machine memory available fell below {MIN_AVAILABLE_MB} MiB")
        return check(statuses)
    return wrapped


def wait_all(cluster: Cluster, names: set[str], timeout: float) -> dict:
    def ok(s: dict) -> bool:
        return names <= {n for n, d in s.items() if d.get("ready")} and all(
            {m["node_id"] for m in s[n]["members"] if m["voter"]} == names for n in names)
    return cluster.wait_for(f"{sorted(names)} ready and voters", guarded(ok), timeout, interval=1.0)


def poll_all(cluster: Cluster, names: set[str], timeout: float = 60.0) -> dict:
    """Statuses of every site: a loaded site's loop can stall past one poll's 2 s, so ask again."""
    deadline = time.monotonic() + timeout
    statuses = cluster.poll()
    while not names <= set(statuses) and time.monotonic() < deadline:
        time.sleep(1.0)
        statuses.update(cluster.poll())
    return statuses


def commit_latencies(root: Path, holder: str, t0: float, t1: float) -> tuple[list[int], list[float]]:
    """Fragment commits the holder recorded in [t0, t1] and, for each, the delay to every other
    node's apply of the same index."""
    histories = load_histories(find_history_files(root))
    commits = {e.index: e.t_wall for e in histories.get(holder, [])
               if e.kind == "commit" and e.detail.get("entry_kind") == "outer_commit" and t0 <= e.t_wall <= t1}
    delays = []
    for node, events in histories.items():
        if node == holder:
            continue
        for e in events:
            if e.kind == "apply" and e.index in commits:
                delays.append(max(0.0, e.t_wall - commits[e.index]))
    return sorted(commits), delays


def run_one(spec: RunSpec, root: Path, startup_s: float) -> dict:
    n_params, largest_fragment = param_count(spec)
    settings = settings_for(spec)
    link = lambda: LinkShape(bandwidth_mbit=spec.link_mbit, latency_ms=spec.latency_ms)  # noqa: E731
    names = [f"s{i}" for i in range(spec.sites)]
    # Witnesses first: the founder then commits nothing while the others download the state (on
    # a loaded machine a founder that trains and serves downloads at once stalls them for minutes).
    roles = {n: ("witness" if i < spec.witnesses else "learner") for i, n in enumerate(names)}
    bound = memory_bound(n_params, largest_fragment)
    out: dict = {"params": n_params, "largest_fragment_params": largest_fragment,
                 # docs/SCALE.md "Memory bound": the formula's terms and the issue's target, MiB
                 "memory_bound_mb": {**{k: round(v / MiB, 1) for k, v in asdict(bound).items()},
                                     "total": round(bound.total / MiB, 1),
                                     "target": round(issue_target_bytes(n_params) / MiB, 1)},
                 "model": spec.params, "sites": spec.sites,
                 "fanout": spec.fanout if spec.fanout else spec.sites - 1, "relays": spec.fanout > 0, "spec": asdict(spec), "roles": roles, "settings": list(settings)}
    print(f"run {spec}", flush=True)
    started = time.monotonic()
    with Cluster.create(root) as cluster, RssSampler() as sampler:
        try:
            sampler.mark(f"{names[0]} start-up")
            founder = cluster.add(names[0], settings=settings, link=link(),
                                  role=None if roles[names[0]] == "learner" else "witness")
            _watch(sampler, cluster, names[0])
            cluster.wait_for("founder ready", guarded(lambda s: s.get(names[0], {}).get("ready", False)), startup_s, 1.0)
            # One joiner at a time: M state downloads at once would measure the start, not the run.
            for i, n in enumerate(names[1:], start=2):
                sampler.mark(f"{n} joins (state download)")
                cluster.add(n, bootstrap=founder, settings=settings, link=link(),
                            role=None if roles[n] == "learner" else "witness")
                _watch(sampler, cluster, n)
                before = wait_all(cluster, set(names[:i]), startup_s)
            before = wait_all(cluster, set(names), startup_s)
            sampler.mark("window (commits)")
        except (AssertionError, OutOfMemory) as error:
            out["error"] = f"did not start: {error}"[:2000]
            out["started_sites"] = sorted(cluster.sites)
            out["peak_rss_mb"] = _peak_rss_mb(cluster)
            out["rss_bytes_per_param"] = {n: round(mb * MiB / n_params, 1) for n, mb in out["peak_rss_mb"].items()}
            out["exited"] = {n: s.process.returncode for n, s in cluster.sites.items() if not s.running}
            return _with_samples(out, sampler, n_params)
        out["startup_s"] = round(time.monotonic() - started, 1)
        t0 = time.time()
        holders = {cluster.coordinator(before)}
        loads = []
        deadline = time.monotonic() + spec.duration_s
        while time.monotonic() < deadline:
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            if available_mb() < MIN_AVAILABLE_MB:
                out["error"] = f"stopped after {time.time() - t0:.0f} s: machine memory available below {MIN_AVAILABLE_MB} MiB"
                out["peak_rss_mb"] = _peak_rss_mb(cluster)
                out["rss_bytes_per_param"] = {n: round(mb * MiB / n_params, 1) for n, mb in out["peak_rss_mb"].items()}
                return _with_samples(out, sampler, n_params)
            statuses = cluster.poll()
            holders.add(cluster.coordinator(statuses))
            loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
        after = poll_all(cluster, set(names))
        t1 = time.time()
        window = t1 - t0
        holder = cluster.coordinator(after)
        holders.add(holder)
        out["holder"] = holder
        out["holder_changed"] = len(holders - {None}) != 1
        peak = _peak_rss_mb(cluster)
        out["duration_s"] = round(window, 1)
        missing = set(names) - (set(after) & set(before))
        if holder is None or missing:
            out["error"] = f"no single holder at the end or sites not answering: {sorted(missing)}"
            out["peak_rss_mb"] = peak
            return _with_samples(out, sampler, n_params)
        commits, delays = commit_latencies(root, holder, t0, t1)
        out["commits"] = len(commits)
        sent = after[holder]["bytes"]["sent"] - before[holder]["bytes"]["sent"]
        log_growth = after[holder]["log_bytes"] - before[holder]["log_bytes"]
        entries = after[holder]["commit_index"] - before[holder]["commit_index"]
        delta_bytes = log_growth / entries if entries > 0 else None
        out["delta_bytes_per_commit"] = delta_bytes
        out["coordinator_egress_bytes"] = sent
        out["coordinator_egress_per_commit_over_delta"] = (
            sent / len(commits) / delta_bytes if commits and delta_bytes else None)
        # Where the holder's bytes went: copies pushed as the tree's root (pushed), fetch answers
        # (served, counted in forwarded_bytes), fetches and forwards at every site, in the window.
        out["relays"] = {n: {k: after[n]["relays"][k] - before[n]["relays"].get(k, 0)
                             for k in ("pushed", "forwarded", "served", "fetched", "refused",
                                       "pushed_bytes", "forwarded_bytes")}
                         for n in names if "relays" in after.get(n, {}) and "relays" in before.get(n, {})}
        out["commit_to_applied_s"] = {"p50": percentile(delays, 0.5), "p99": percentile(delays, 0.99),
                                      "samples": len(delays)}
        out["peak_rss_mb"] = peak
        out["rss_bytes_per_param"] = {n: round(mb * MiB / n_params, 1) for n, mb in peak.items()}
        out["state_mb"] = round(8 * n_params / MiB, 1)
        rate_Bps = spec.link_mbit * 1e6 / 8
        out["link_utilization"] = {
            # commits leave the holder through this many links: every follower's, or the tree's first level
            "holder_egress": sent / (rate_Bps * window * max(1, min(out["fanout"], spec.sites - 1))),
            "per_node": {n: {"in": (after[n]["bytes"]["received"] - before[n]["bytes"]["received"]) / (rate_Bps * window),
                             "out": (after[n]["bytes"]["sent"] - before[n]["bytes"]["sent"]) / (rate_Bps * window)}
                         for n in names if n in after and n in before}}
        # Every (index, digest) any site reported while ready, across the run: one digest per index.
        out["digests_agree"] = cluster.conflicting_indices() == {}
        out["load_average_1m"] = {"min": min(loads, default=None), "max": max(loads, default=None)}
        sampler.mark("end")
    _with_samples(out, sampler, n_params)
    out["within_bound"] = {n: mb <= out["memory_bound_mb"]["total"] for n, mb in out["peak_rss_mb"].items()}
    print(json.dumps({k: v for k, v in out.items() if k not in ("settings", "spec", "rss_samples")}), flush=True)
    return out


def _watch(sampler: RssSampler, cluster: Cluster, name: str) -> None:
    site = cluster.sites[name]
    sampler.watch(name, site.pid)
    if site.link is not None:
        sampler.watch(f"link:{name}", site.link.pid)


def _with_samples(out: dict, sampler: RssSampler, n_params: int) -> dict:
    """`out` with the sampler's report, its table printed, and the CPU-seconds per GB of state each
    process spent while a site downloaded the state (state: 8 bytes a parameter)."""
    report = sampler.report()
    out["rss_samples"] = report
    state_gb = 8 * n_params / 1e9
    out["download_cpu_s_per_gb"] = {
        phase: {name: round(proc["phases"][phase]["cpu_s"] / state_gb, 2)
                for name, proc in report["processes"].items() if phase in proc["phases"]}
        for _, phase in report["marks"] if phase.endswith("(state download)")}
    print(rss_table(report), flush=True)
    return out


def _peak_rss_mb(cluster: Cluster) -> dict[str, float]:
    out = {}
    for n, site in cluster.sites.items():
        rss = peak_rss_bytes(site.pid) if site.running else None
        if rss is not None:
            out[n] = round(rss / MiB, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named list of runs (default: one run from the flags)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 sites of a 1M model for 10 s")
    parser.add_argument("--params", choices=sorted(MODELS), default="100m", help="model size (a llama preset)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the model's vocabulary (default: the preset's; 1b's 128,256 makes a 2 GB embedding fragment)")
    parser.add_argument("--sites", type=int, default=4, help="daemons, witnesses included")
    parser.add_argument("--witnesses", type=int, default=1, help="how many of the sites are witnesses")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--period", type=int, default=40, help="synthetic steps between two sends of a fragment")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured after every site is ready")
    parser.add_argument("--link-mbit", type=float, default=1000.0, help="emulated link rate into each site")
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--steps-per-s", type=float, default=2.0, help="synthetic learner step rate")
    parser.add_argument("--fanout", type=int, default=0,
                        help="relay fan-out: every site's [node] relay_fanout (0: no relays)")
    parser.add_argument("--startup-s", type=float, default=600.0, help="give up on a run not ready by then")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (logs, histories)")
    parser.add_argument("--stages", action="store_true",
                        help="only time the syncer's stages (benchmarks/contribution_stages.py), no daemons")
    args = parser.parse_args(argv)
    if args.stages or not args.quick:  # the smoke run skips them: its model is too small to time
        from contribution_stages import syncer_stages

        stages = {"syncer_stages_cpu_s_per_GB": syncer_stages(), "load_avg": os.getloadavg()}
        if args.stages:
            Path(args.json).write_text(json.dumps(stages, indent=1) + "\n")
            print(json.dumps(stages))
            return 0
    else:
        stages = {}
    if not 0 <= args.fanout <= 16:
        parser.error(f"--fanout {args.fanout}: must be in [0, 16] (0: no relays)")
    if args.quick:
        runs = [replace(spec, fanout=args.fanout) for spec in PRESETS["quick"]]
    elif args.preset:
        runs = [replace(spec, fanout=args.fanout) for spec in PRESETS[args.preset]]
    else:
        if args.sites < 2 or not 0 <= args.witnesses < args.sites:
            parser.error(f"--sites {args.sites} --witnesses {args.witnesses}: need >= 2 sites and >= 1 learner")
        runs = [RunSpec(args.params, args.sites, args.witnesses, args.fragments, args.period, args.steps_per_s,
                        args.duration, args.link_mbit, args.latency_ms, args.fanout, args.vocab_size)]
    # SIGTERM unwinds like Ctrl-C, so every daemon and link this run started is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="diloco-dataplane-"))
    results: dict = {"machine": {"cpus": os.cpu_count(), "memory_gib": _memory_gib(),
                                 "note": "shared with other jobs; latencies are noisy, peak RSS is not"},
                     **stages, "runs": []}
    try:
        for i, spec in enumerate(runs):
            results["runs"].append(run_one(spec, root / f"run{i}", args.startup_s))
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"runs kept under {root}")
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all("error" not in r for r in results["runs"]) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _memory_gib() -> float | None:
    try:
        total = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        return round(int(total) / 1024 / 1024, 1)
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
