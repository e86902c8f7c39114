"""A short run of real `diloco-node run` sites that train on this host's accelerator.

    .venv/bin/python benchmarks/accelerator_sites.py --sites 2 --duration 90 --json sites.json

Every site is a real daemon process on loopback (founder first, the others join through it), all
sharing the host's accelerator: each JAX process is told not to preallocate and takes at most
`--memory-fraction` of the device. The model is the built-in llama (`--size`, bf16 compute) on the
default corpus (the Python standard library's source as bytes: nothing is downloaded), with
`[node.mesh] platform` set so that a site with CPU JAX refuses to start rather than train on the
CPU. Reported per site from its own `/status`: the devices it trains on, its step, tokens/s and
the learner figures it shows; for the run: commits, and whether every site agreed on the state
digest at every commit index two of them reported.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_node.testbed.local_cluster import Cluster  # noqa: E402

STARTUP_S = 300.0  # compiling a 100M-parameter llama's step on a GPU takes tens of seconds
LOG_TAIL_LINES = 15


def settings(args: argparse.Namespace) -> list[str]:
    return [
        "run.model.factory=llama", f"run.model.size={args.size}", "run.model.vocab_size=256",
        f"run.model.seq_len={args.seq_len}", 'run.model.compute_dtype="bfloat16"',
        f"run.inner.batch_size={args.batch_size}", "run.inner.warmup_steps=50", "run.inner.total_steps=100000",
        f"run.sync.fragments={args.fragments}", f"run.sync.period={args.period}",
        "checkpoint_interval_s=60", "eval_interval_commits=20", "eval_batches=2",
        f"mesh.platform={args.platform}", f"mesh.attention={args.attention}", f"mesh.remat={args.remat}",
    ]


def site_env(args: argparse.Namespace) -> dict[str, str]:
    # The test launcher pins children to one CPU thread and CPU JAX; these undo that for an
    # accelerator and share its memory between the sites' processes.
    return {"JAX_PLATFORMS": args.jax_platforms, "XLA_FLAGS": "", "OMP_NUM_THREADS": "4",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": str(args.memory_fraction),
            "DILOCO_X_MIN_STEP_S": "0"}


def learner_row(node_id: str, doc: dict) -> dict:
    learner = doc.get("learner", {})
    return {"site": node_id, "devices": doc.get("devices"), "step": learner.get("step"),
            "tokens_per_s": learner.get("tokens_per_s"), "step_time_s": learner.get("step_time_s"),
            "mfu": learner.get("mfu"), "grad_norm": learner.get("grad_norm"), "lr": learner.get("lr"),
            "loss": learner.get("loss"), "commit_index": doc.get("commit_index")}


def run_sites(cluster: Cluster, args: argparse.Namespace, report: dict, began: float) -> None:
    """Found, join, train for `--duration`, stop; fills `report`."""
    founder = cluster.add("site-a", settings=settings(args), env=site_env(args))
    names = {"site-a"}
    cluster.wait_for("site-a ready", lambda s: bool(s.get("site-a", {}).get("ready")), STARTUP_S)
    print(f"{time.monotonic() - began:.0f} s: site-a founded the run and is ready", flush=True)
    for i in range(1, args.sites):
        name = f"site-{chr(ord('a') + i)}"
        cluster.add(name, bootstrap=founder, settings=settings(args), env=site_env(args))
        names.add(name)
    started = time.monotonic()
    cluster.wait_for("every site ready and training",
                     lambda s: all(s.get(n, {}).get("ready") and s[n].get("learner", {}).get("step", 0) > 0
                                   for n in names), STARTUP_S)
    report["seconds_to_all_training"] = round(time.monotonic() - started, 1)
    print(f"{time.monotonic() - began:.0f} s: every site is ready and training", flush=True)
    first = cluster.poll()
    first_index = max(d.get("commit_index", 0) for d in first.values())
    deadline = time.monotonic() + args.duration
    while time.monotonic() < deadline:
        cluster.poll()
        time.sleep(1.0)
    last = cluster.poll()
    report["commits"] = max(d.get("commit_index", 0) for d in last.values()) - first_index
    report["shared_indices"] = cluster.shared_indices()
    report["conflicting_indices"] = {str(k): sorted(v) for k, v in cluster.conflicting_indices().items()}
    report["sites"] = [learner_row(n, last[n]) for n in sorted(last)]
    for name in sorted(names):
        cluster.sites[name].signal(15)
    for name in sorted(names):
        report.setdefault("exit_codes", {})[name] = cluster.sites[name].wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of training once every site is ready")
    parser.add_argument("--size", default="100m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--period", type=int, default=32)
    parser.add_argument("--platform", default="gpu", help="[node.mesh] platform the sites expect")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--jax-platforms", default="cuda,cpu", help="JAX_PLATFORMS of the site processes")
    parser.add_argument("--memory-fraction", type=float, default=0.4, help="of the device, per site process")
    parser.add_argument("--root", type=Path, help="where data and logs go (default: a new temporary directory)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="diloco-accel-"))
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "root": str(root)}
    # A time limit's SIGTERM still runs the `finally` below: the sites' own logs say how far they got.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    began = time.monotonic()
    with Cluster.create(root) as cluster:
        try:
            run_sites(cluster, args, report, began)
        finally:
            if "sites" not in report:  # cut short: each site's last log lines say how far it got
                for name, site in cluster.sites.items():
                    tail = "\n".join(site.log_text().splitlines()[-LOG_TAIL_LINES:])
                    print(f"--- {name}'s log, last lines:\n{tail}", flush=True)
    print(json.dumps(report, indent=1, default=str))
    print(f"{args.sites} sites on {report['sites'][0]['devices']}: {report['commits']} commits in "
          f"{args.duration:.0f} s, {report['shared_indices']} indices compared, "
          f"{len(report['conflicting_indices'])} with differing digests")
    for row in report["sites"]:
        print(f"  {row['site']}: step {row['step']}, {row['tokens_per_s']} tokens/s, mfu {row['mfu']}, "
              f"loss {row['loss']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if not report["conflicting_indices"] else 1


if __name__ == "__main__":
    sys.exit(main())
