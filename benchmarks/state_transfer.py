"""Benchmark: a joiner downloads the global state from 3 peers at once through capped links.

Three peer servers serve the same global state (same seed, same bytes) over the real transport
(authenticated frames, `SnapshotRequest`/`SnapshotChunk`), each behind its own link emulator
process capped at `--link-mbit`. A joiner process runs the daemon's own `FragmentDownload` and
installs every fragment after checking its SHA-256; the final state digest must equal the
servers'. Reported: bytes, seconds, aggregate throughput and its share of the 3 links' capacity
(`utilization`, target >= 0.9), each process's peak RSS, and the CPU-seconds per GB received of the
joiner (`receiver`), the servers (`sender`) and, apart, the link emulators (`cpu_s_per_GB`).

`--cut-after S` kills one link emulator (SIGKILL: every connection through it reset, the peer
unreachable from then on) S seconds into the download: the fragment it was carrying resumes at
the offset reached on another peer. `refetched_bytes` is what the cut cost.

To fit this machine, the three servers are one process sharing one copy of the state (each
server has its own port, link and connections); everything on the path is real.

    .venv/bin/python benchmarks/state_transfer.py --params 100e6 --link-mbit 1000 --json out.json
    .venv/bin/python benchmarks/state_transfer.py --params 100e6 --link-mbit 200 --cut-after 5

MB = 10^6 bytes; Mbit = 10^6 bits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

MB = 1_000_000
RUN_ID = "bench-state-transfer"
BENCH_SECRET = b"benchmark-secret-not-for-production"  # loopback only
WIDTH = 4096  # columns of every synthetic tensor
PEERS = 3


def _rss_mb(field: str = "VmHWM") -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) a process has used, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _auth(node: str):
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key

    key = derive_frame_key(BENCH_SECRET)
    return AuthContext(RUN_ID, node, key), FrameVerifier(RUN_ID, key)


def _replica(params: int, fragments: int, *, seed: int | None):
    """A replica of `params` parameters in tensors of WIDTH columns; random from `seed`, or zeros."""
    import numpy as np

    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    rows = max(1, params // WIDTH // (2 * fragments))  # two tensors per fragment
    rng = np.random.default_rng(seed) if seed is not None else None
    initial = {}
    for i in range(2 * fragments):
        shape = (rows, WIDTH)
        initial[f"block{i:03d}/w"] = (rng.standard_normal(shape, dtype=np.float32) if rng is not None
                                      else np.zeros(shape, np.float32))
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, fragments, 100, 1)
    return Replica(plan, initial, OuterOptimizer(), adopt_initial=True)  # fresh arrays: no second copy


# ---- the three servers (one process) -----------------------------------------------------------


async def _servers(params: int, fragments: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from aiohttp import web

    from diloco_node.daemon.plan import CODEC_THREADS
    from diloco_node.daemon.state_transfer import ServedFragments
    from diloco_node.transport import PeerServer
    from wire import messages as wire
    from wire.messages import MessageKind

    replica = _replica(params, fragments, seed=1)
    # The daemon's own serving path (daemon/state_transfer.py): chunks read from the state's arrays
    # in the codec pool, each fragment's digest remembered.
    served = ServedFragments(replica)
    codec = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="codec")
    state_bytes = sum(served.read(p, 0, 0)[1] for p in range(fragments))

    async def on_snapshot_request(message: wire.SnapshotRequest, peer: object) -> wire.SnapshotChunk:
        _, total, digest, part = await asyncio.get_running_loop().run_in_executor(
            codec, served.read, message.fragment, message.offset, message.max_length)
        return wire.SnapshotChunk(message.fragment, 1, min(message.offset, total), total, digest, part)

    runners, ports = [], []
    for i in range(PEERS):
        auth, verifier = _auth(f"peer-{i}")
        server = PeerServer(auth, verifier)
        server.on_message(MessageKind.SNAPSHOT_REQUEST, on_snapshot_request)
        app = web.Application()
        server.install(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"ports": ports, "digest": replica.state.digest(), "state_bytes": state_bytes,
                      "params": replica.state.num_params if hasattr(replica.state, "num_params") else None}),
          flush=True)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()
    print(json.dumps({"peak_rss_MB": round(_rss_mb(), 1)}), flush=True)


# ---- the joiner ---------------------------------------------------------------------------------


async def _joiner(urls: list[str], params: int, fragments: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from diloco_node.clock import SystemClock
    from diloco_node.daemon.join import FragmentDownload
    from diloco_node.daemon.plan import CODEC_THREADS
    from diloco_node.transport import PeerClient

    replica = _replica(params, fragments, seed=None)
    auth, verifier = _auth("joiner")
    codec = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="codec")  # the daemon's codec pool
    async with PeerClient(auth, verifier, executor=codec) as client:
        download = FragmentDownload(client, replica, lambda: urls, executor=codec, clock=SystemClock())
        print(json.dumps({"started": True}), flush=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        await download.run()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "bytes_received": download.bytes_received,
                      "digest": replica.state.digest(), "peak_rss_MB": round(_rss_mb(), 1)}), flush=True)


# ---- orchestration ------------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)


def run_once(params: int, fragments: int, link_mbit: float, cut_after_s: float | None) -> dict:
    servers = _spawn(__file__, "--role", "servers", "--params", str(params), "--fragments", str(fragments))
    links: list[subprocess.Popen[str]] = []
    joiner = None
    try:
        served = json.loads(servers.stdout.readline())
        urls = []
        for port in served["ports"]:
            link = _spawn("-m", "diloco_node", "linkemu", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}",
                          "--bandwidth-mbit", str(link_mbit))
            links.append(link)
            urls.append("http://127.0.0.1:" + link.stdout.readline().split()[3].rsplit(":", 1)[1])
        joiner = _spawn(__file__, "--role", "joiner", "--params", str(params), "--fragments", str(fragments),
                        "--urls", ",".join(urls))
        json.loads(joiner.stdout.readline())  # the joiner's state is allocated: the download starts now
        cpu_before = {"servers": _cpu_s(servers.pid), **{f"link{i}": _cpu_s(link.pid) for i, link in enumerate(links)}}
        cut_at = None
        if cut_after_s is not None:
            time.sleep(cut_after_s)
            links[1].send_signal(signal.SIGKILL)
            cut_at = cut_after_s
        result = json.loads(joiner.stdout.readline())
        cpu_after = {"servers": _cpu_s(servers.pid), **{f"link{i}": _cpu_s(link.pid) for i, link in enumerate(links)}}
        joiner.wait(60)
    finally:
        for proc in (*links, servers):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        if joiner is not None and joiner.poll() is None:
            joiner.kill()
    server_report = json.loads(servers.stdout.readline() or "{}")
    for proc in (*links, servers, joiner):
        if proc is not None:
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
    if result["digest"] != served["digest"]:
        raise RuntimeError(f"joiner's state digest {result['digest']} != the servers' {served['digest']}")
    capacity_Bps = PEERS * link_mbit * 1e6 / 8
    throughput = served["state_bytes"] / result["seconds"]
    gb = result["bytes_received"] / 1e9
    spent = {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
    return {
        "params": params,
        "fragments": fragments,
        "state_MB": round(served["state_bytes"] / MB, 1),
        "peers": PEERS,
        "link_mbit": link_mbit,
        "seconds": round(result["seconds"], 2),
        "aggregate_MBps": round(throughput / MB, 1),
        "utilization": round(throughput / capacity_Bps, 3),
        "cut_after_s": cut_at,
        "refetched_bytes": result["bytes_received"] - served["state_bytes"],
        "digest_verified": True,
        "peak_rss_MB": {"joiner": result["peak_rss_MB"], "servers": server_report.get("peak_rss_MB")},
        # CPU-seconds per GB (10^9 bytes) received, over the download: the joiner (receive: frames,
        # hash, decode, check, install), the servers (send: the 3 servers share a process), and the
        # link emulators apart (they are the benchmark's, not a site's)
        "cpu_s_per_GB": {"receiver": round(result["cpu_s"] / gb, 3), "sender": round(spent["servers"] / gb, 3),
                         "link_emulators": round(sum(v for k, v in spent.items() if k.startswith("link")) / gb, 3)},
        "cpu_s": {"receiver": round(result["cpu_s"], 2), **{k: round(v, 2) for k, v in spent.items()}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the global state")
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--link-mbit", type=float, default=1000.0, help="cap of each of the 3 links")
    parser.add_argument("--cut-after", type=float, default=None, metavar="S", help="kill one link S seconds in")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=("servers", "joiner"), help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    params = int(args.params)
    if params < WIDTH * 2 * args.fragments:
        parser.error(f"--params must be at least {WIDTH * 2 * args.fragments} for {args.fragments} fragments")
    if args.role == "servers":
        asyncio.run(_servers(params, args.fragments))
        return 0
    if args.role == "joiner":
        asyncio.run(_joiner(args.urls.split(","), params, args.fragments))
        return 0
    report = run_once(params, args.fragments, args.link_mbit, args.cut_after)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
