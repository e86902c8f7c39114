"""The multi-process demo: four `diloco-node run` sites on loopback behind WAN link emulators.

Every site's inbound traffic crosses its own `linkemu` proxy (bandwidth cap and latency), so all
cross-site bytes pay WAN prices. The demo founds a run on site a, joins b, c, d through a's
emulated address, shows live progress, SIGKILLs the coordinator midway and restarts it from its
checkpoint, then stops every site with SIGTERM and prints a summary: eval loss of the global
model at the start and the end (evaluated here from a site's final checkpoint), commits,
failovers and failover time, and bytes that crossed sites against what data-parallel training
would have moved for the same steps. Exit 0 on success, non-zero with the reason otherwise; no
process is left behind.

    diloco-node demo [--train-s 90] [--bandwidth-mbit 50] [--latency-ms 40]   (diloco_node/cli/demo.py)
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, LinkShape, Site
from diloco_node.testbed.local_cluster import Cluster

SITES = ("a", "b", "c", "d")
STARTUP_S = 240.0  # four JAX processes compiling at once on two cores
EVAL_BATCHES = 8
EVAL_BATCH_SIZE = 16
DEMO_SETTINGS = (*DEFAULT_SETTINGS, "run.inner.batch_size=8", "run.sync.period=16", "run.sync.fragments=4",
                 "run.inner.warmup_steps=20", "checkpoint_interval_s=5")


class DemoFailed(Exception):
    pass


def _line(statuses: dict, t0: float) -> str:
    parts = []
    for node_id in SITES:
        doc = statuses.get(node_id)
        if doc is None:
            parts.append(f"{node_id}:down")
            continue
        loss = doc["learner"]["loss"]
        parts.append(f"{node_id}:#{doc['commit_index']} s{doc['learner']['step']} "
                     f"l{loss:.2f}" if loss is not None else f"{node_id}:#{doc['commit_index']} (starting)")
    holders = {d.get("coordinator") for d in statuses.values() if d.get("coordinator")}
    return f"[{time.monotonic() - t0:6.1f}s] coordinator={','.join(sorted(holders)) or '-'}  " + "  ".join(parts)


def _watch(cluster: Cluster, seconds: float, t0: float, every: float = 3.0) -> dict:
    end = time.monotonic() + seconds
    statuses: dict = {}
    while time.monotonic() < end:
        statuses = cluster.poll()
        print(_line(statuses, t0), flush=True)
        time.sleep(min(every, max(0.0, end - time.monotonic())))
    return statuses


def _evaluate(checkpoint_dir: Path, settings: tuple[str, ...]) -> tuple[float, float, int]:
    """(eval loss of the initial model, of the final global model, parameter count)."""
    from diloco_node.config.settings import load_config
    from diloco_node.learn import data as data_lib
    from diloco_node.learn import factory
    from diloco_node.learn import model as model_lib
    from diloco_node.ops.checkpoint import CheckpointStore
    from diloco_node.sync import state_codec

    overrides = dict(setting.split("=", 1) for setting in settings if setting.startswith(("run.", "data.")))
    config = load_config(None, {}, overrides)
    manifest = config.run
    corpus = data_lib.open_site_data(config.node.data, None)  # the sites' own data (the stdlib by default)
    _, params = factory.init_params(manifest.model, manifest.seed)
    evaluate = factory.eval_fn(factory.recipe(manifest.model))
    inputs, targets = data_lib.eval_batches(corpus.eval, EVAL_BATCHES, EVAL_BATCH_SIZE, manifest.model.seq_len)
    start = float(evaluate(params, inputs, targets))
    with CheckpointStore(checkpoint_dir) as store:
        loaded = store.load_latest()
    if loaded is None:
        raise DemoFailed(f"no checkpoint in {checkpoint_dir}")
    flat = state_codec.params_from_checkpoint(loaded.checkpoint.arrays)
    end = float(evaluate(model_lib.load_flat_params(params, flat), inputs, targets))
    return start, end, model_lib.count_params(params)


def run_demo(args: argparse.Namespace) -> int:
    """The demo; every site and link is killed on the way out. The run directory (logs and
    checkpoints, a few MB) is kept for inspection; its path is printed."""
    t0 = time.monotonic()
    with Cluster.create(Path(tempfile.mkdtemp(prefix="diloco-demo-"))) as cluster:
        try:
            return _run_sites(cluster, args, t0)
        except (DemoFailed, AssertionError) as error:
            print(f"demo FAILED: {error}", file=sys.stderr, flush=True)
            return 1


def _run_sites(cluster: Cluster, args: argparse.Namespace, t0: float) -> int:
    print(f"demo: 4 sites, each behind a {args.bandwidth_mbit:g} Mbit/s, {args.latency_ms:g} ms link; "
          f"logs in {cluster.root}", flush=True)
    sites: dict[str, Site] = {}
    for node_id in SITES:
        link = LinkShape(bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms)
        sites[node_id] = cluster.add(node_id, bootstrap=sites.get("a"), settings=DEMO_SETTINGS, link=link,
                                     start=node_id == "a")
        if node_id == "a":
            cluster.wait_for("site a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
            print(f"[{time.monotonic() - t0:6.1f}s] a founded the run", flush=True)
    for node_id in SITES[1:]:
        sites[node_id].start()
    cluster.wait_for("all four sites ready", lambda s: all(s.get(n, {}).get("ready") for n in SITES), STARTUP_S)
    print(f"[{time.monotonic() - t0:6.1f}s] all four sites joined and ready", flush=True)

    statuses = _watch(cluster, args.train_s / 2, t0)
    leader = cluster.coordinator(statuses)
    if leader is None:
        raise DemoFailed("no single coordinator before the kill")
    before = max(d["commit_index"] for d in statuses.values())
    print(f"[{time.monotonic() - t0:6.1f}s] SIGKILL coordinator {leader} at commit #{before}", flush=True)
    sites[leader].kill()
    killed_at = time.monotonic()
    survivors = [n for n in SITES if n != leader]
    cluster.wait_for("a new coordinator committing", lambda s: len({s[n].get("coordinator") for n in survivors
                                                                    if n in s} - {None, leader}) == 1
                     and max(s[n]["commit_index"] for n in survivors if n in s) > before, 90)
    failover_s = time.monotonic() - killed_at
    print(f"[{time.monotonic() - t0:6.1f}s] failover: new coordinator commits {failover_s:.1f} s after the kill; "
          f"restarting {leader} from its checkpoint", flush=True)
    sites[leader].start()
    cluster.wait_for(f"{leader} back and ready", lambda s: s.get(leader, {}).get("ready", False), STARTUP_S)
    statuses = _watch(cluster, args.train_s / 2, t0)
    conflicts = cluster.conflicting_indices()
    if conflicts:
        raise DemoFailed(f"sites reported different state digests at indices {sorted(conflicts)[:5]}")
    shared = cluster.shared_indices()
    if shared == 0:
        raise DemoFailed("no commit index was reported by two sites: the digest check compared nothing")
    steps = sum(d["learner"]["step"] for d in statuses.values())
    commits = max(d["commit_index"] for d in statuses.values())
    sent = sum(d["bytes"]["sent"] for d in statuses.values())
    for site in sites.values():
        site.signal(signal.SIGTERM)
    codes = {n: site.wait(90) for n, site in sites.items()}
    if any(code != 0 for code in codes.values()):
        raise DemoFailed(f"not every site stopped cleanly on SIGTERM: exit codes {codes}")
    loss_start, loss_end, n_params = _evaluate(sites["a"].data_dir / "checkpoints", DEMO_SETTINGS)
    dp_bytes = steps * 2 * 4 * n_params  # every step, each learner sends and receives an fp32 gradient
    print("\nsummary", flush=True)
    print(f"  eval loss of the global model: start {loss_start:.3f} -> end {loss_end:.3f}")
    print(f"  commits: {commits}; failovers: 1 ({failover_s:.1f} s from SIGKILL to the next commit)")
    print(f"  state digests: every site agreed at each of the {shared} commit indices two or more sites reported")
    print(f"  learner steps (all sites): {steps}; model parameters: {n_params}")
    print(f"  bytes sent between sites (all traffic, incl. coordination): {sent / 1e6:.2f} MB; "
          f"data-parallel for the same steps: {dp_bytes / 1e6:.1f} MB ({dp_bytes / max(sent, 1):.0f}x more)")
    print(f"  wall time: {time.monotonic() - t0:.0f} s; logs and checkpoints: {cluster.root}")
    if not loss_end < loss_start:
        raise DemoFailed(f"the global model did not improve: eval loss {loss_start:.3f} -> {loss_end:.3f}")
    return 0
