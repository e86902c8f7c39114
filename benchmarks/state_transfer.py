"""Benchmark: a joiner downloads the global state from 3 peers at once through capped links.

Three peer servers serve the same global state (same seed, same bytes) over the real transport
(authenticated frames, `SnapshotRequest`/`SnapshotChunk`), each behind its own link emulator
process capped at `--link-mbit`. A joiner process runs the daemon's own `FragmentDownload` and
installs every fragment after checking its state digest (wire 3.0: computed while the chunks are
decoded); the final state digest must equal the servers'. Reported: bytes, seconds, aggregate
throughput and its share of the 3 links' capacity (`utilization`, target >= 0.9), each process's
peak RSS, the CPU-seconds per GB received of the joiner (`receiver`), the servers (`sender`) and,
apart, the link emulators (`cpu_s_per_GB`), and the receiver's CPU-seconds per GB by stage (TLS,
frames, hash, decode, first touch of pages, finiteness), each timed alone on one fragment's bytes
(`receiver_stages_cpu_s_per_GB`, `receive_stages`; alone with `--stages`). The joiner's CPU is
also split by thread (`receiver_threads_cpu_s_per_GB`: the event loop, the codec pool) and its
page faults counted (`receiver_page_faults_per_GB`): what the stages, timed alone, leave out.

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
    return _cpu_s_of(Path(f"/proc/{pid}/stat"))


def _thread_cpu_s() -> dict[str, float]:
    """CPU-seconds each group of this process's threads has used: the event loop's (the main
    thread: sockets, HTTP, asyncio), the codec pool's (frames, hashes, decode, checks), the rest."""
    import threading

    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    groups: dict[str, float] = {"event_loop": 0.0, "codec_pool": 0.0, "other": 0.0}
    for task in Path("/proc/self/task").iterdir():
        try:
            spent = _cpu_s_of(task / "stat")
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name), "")
        group = "event_loop" if int(task.name) == os.getpid() else "codec_pool" if name.startswith("codec") else "other"
        groups[group] += spent
    return groups


def _cpu_s_of(stat_path: Path) -> float:
    stat = stat_path.read_text()
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
    import resource
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
        threads_start = _thread_cpu_s()
        faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, cpu_start = time.perf_counter(), time.process_time()
        await download.run()
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start
        threads = {name: spent - threads_start.get(name, 0.0) for name, spent in _thread_cpu_s().items()}
    print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "threads_cpu_s": threads, "page_faults": faults,
                      "bytes_received": download.bytes_received,
                      "digest": replica.state.digest(), "peak_rss_MB": round(_rss_mb(), 1)}), flush=True)


# ---- the receive path by stage ------------------------------------------------------------------

STAGE_BYTES = 64 * MB  # one synthetic fragment's arrays, what each stage is timed over
# Fresh memory first touched by a new process (the joiner's state at 100e6 parameters): more than
# the few hundred MB a process usually finds warm, bounded to fit the machine.
COLD_TOUCH_BYTES = 800 * MB
TLS_RECORD_BYTES = 16 * 1024  # a TLS 1.3 record's most plaintext


def receive_stages(fragment_bytes: int = STAGE_BYTES, cold_bytes: int = COLD_TOUCH_BYTES) -> dict[str, float]:
    """CPU-seconds per GB of each stage of the receive path, each timed alone in this thread over
    the same fragment's bytes, the way the joiner runs them (4 MiB SnapshotChunks read in 64 KiB
    pieces): what the end-to-end `receiver` figure is made of. `tls` is AES-256-GCM decryption of
    16 KiB records (what a TLS 1.3 receiver does per byte; this benchmark's loopback path has no TLS,
    so it is not in `receiver`); `frame` is the frame decoder without its payload hash (header
    parse, MAC, buffer copies); `hash` BLAKE3 once over every byte; `decode` the fragment decoder
    without its state hash (msgpack walk and the copy into the fragment's new arrays, so it
    includes their first touch); `first_touch` the kernel's cost of fresh pages as numpy allocates
    them (transparent huge pages asked for), measured on memory this process freed just before
    (warm), `first_touch_4k_pages` the same with 4 KiB pages, and `first_touch_cold` in a fresh
    process over `cold_bytes` (the joiner's case: its state's pages are new to it; on a VM whose
    free huge pages went back to the host this costs several CPU-s per GB); `finite` the
    finiteness scan. The path hashes every byte twice (the frame's payload digest, then the state
    digest as it is decoded): `hash` is one pass. `chunks_one_pass` is the codec pool's whole work
    on the chunks as the joiner does it now (each received piece hashed twice and copied into the
    arrays while it is in cache, never joined), `chunks_joined_then_hashed` the same work the way it
    was done before (each payload joined out of its pieces, hashed, then hashed again and copied)."""
    import numpy as np
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from diloco_node.daemon.join import SNAPSHOT_CHUNK_BYTES
    from diloco_node.sync.outer import all_finite
    from diloco_node.sync.state_codec import FragmentAssembler, FragmentState, encode_fragment, fragment_shapes
    from contribution_stages import hash_pieces, read_frames
    from wire import messages as wire
    from wire.auth import FrameVerifier, derive_frame_key
    from wire.frames import NEED_DATA, FrameDecoder, FrameHeader, encode_frame

    rows = max(1, fragment_bytes // 8 // WIDTH)
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((rows, WIDTH), dtype=np.float32)}
    state = FragmentState(0, 1, params, {"w": params["w"] * 0.5})
    data = encode_fragment(state)
    gb = len(data) / 1e9
    chunks = [data[at:at + SNAPSHOT_CHUNK_BYTES] for at in range(0, len(data), SNAPSHOT_CHUNK_BYTES)]
    auth, _ = _auth("server")
    frames = b"".join(encode_frame(wire.SnapshotChunk(0, 1, i * SNAPSHOT_CHUNK_BYTES, len(data), bytes(32), chunk),
                                   auth, now_unix=time.time(), nonce=os.urandom(16), to="joiner")
                      for i, chunk in enumerate(chunks))
    pieces = [frames[at:at + 65536] for at in range(0, len(frames), 65536)]
    shapes = fragment_shapes({"w": (rows, WIDTH)})

    def timed(work) -> float:
        start = time.process_time()
        work()
        return (time.process_time() - start) / gb

    def verifier() -> FrameVerifier:
        return FrameVerifier(RUN_ID, derive_frame_key(BENCH_SECRET), node_id="joiner")

    def decode_frames() -> None:
        read_frames(verifier(), pieces)

    def chunks_joined() -> None:
        """The chunk path before one-pass receiving: each payload joined out of its pieces and
        hashed for `pd`, then hashed into the state digest and copied into the arrays."""
        decoder, assembler = FrameDecoder(verifier()), FragmentAssembler(shapes)
        for piece in pieces:
            decoder.receive_data(piece)
            while (event := decoder.next_event(now_unix=time.time())) is not NEED_DATA:
                assembler.feed(event.message.payload)
        assembler.finish()

    def chunks_one_pass() -> None:
        """The chunk path now (join.py `_Received.feed`): each received piece hashed for `pd`, then
        into the state digest and copied into the arrays, while it is in cache; never joined."""
        decoder = FrameDecoder(verifier(), stream_kinds=(wire.MessageKind.SNAPSHOT_CHUNK,))
        assembler = FragmentAssembler(shapes)
        in_payload = False
        for piece in pieces:
            decoder.receive_data(piece)
            while True:
                event = (decoder.stream_payload(assembler.feed, now_unix=time.time()) if in_payload
                         else decoder.next_event(now_unix=time.time()))
                if event is NEED_DATA:
                    break
                in_payload = isinstance(event, FrameHeader)
        assembler.finish()

    def hash_all() -> None:
        hash_pieces(chunks)

    def assemble() -> None:
        assembler = FragmentAssembler(shapes)
        for chunk in chunks:
            assembler.feed(chunk)
        assembler.finish()

    # Both arrays of the fragment in one allocation: over glibc's largest mmap threshold (32 MiB),
    # so every fresh one is new pages from the kernel (a 32 MB array would reuse the heap's).
    both = np.concatenate([params["w"].reshape(-1), state.momentum["w"].reshape(-1)])
    reused = np.empty(both.shape, np.float32)
    reused.fill(0)  # touched once: writing it again costs the copy alone

    def write_reused() -> None:
        reused[...] = both

    def write_fresh() -> None:
        fresh = np.empty(both.shape, np.float32)
        fresh[...] = both
        del fresh

    def write_fresh_small_pages() -> None:
        # numpy asks for transparent huge pages on large arrays; a huge page is one fault, but where
        # none is free the kernel may compact memory for it first (THP defrag "madvise"): the
        # fragment arrays' first touch then costs several CPU-s per GB. With 4 KiB pages it is steady.
        hugepages = np._core.multiarray._set_madvise_hugepage(False)
        try:
            write_fresh()
        finally:
            np._core.multiarray._set_madvise_hugepage(hugepages)

    key = AESGCM(bytes(32))
    nonce = bytes(12)
    records = [key.encrypt(nonce, data[at:at + TLS_RECORD_BYTES], None) for at in range(0, len(data), TLS_RECORD_BYTES)]

    def tls() -> None:
        for record in records:
            key.decrypt(nonce, record, None)

    hash_cost = timed(hash_all)
    stages = {
        "tls": timed(tls),
        "frame": timed(decode_frames) - hash_cost,
        "hash": hash_cost,
        "decode": timed(assemble) - hash_cost,
        "first_touch": timed(write_fresh) - timed(write_reused),  # per GB of arrays, as above
        "first_touch_4k_pages": timed(write_fresh_small_pages) - timed(write_reused),
        "first_touch_cold": _first_touch_cold(cold_bytes),
        "finite": timed(lambda: all_finite(state.params["w"]) and all_finite(state.momentum["w"])),
        # The codec pool's whole work on a chunk's bytes, both ways (frames, both hashes, the copy
        # into fresh arrays; memory this process freed before, so their first touch is warm)
        "chunks_joined_then_hashed": timed(chunks_joined),
        "chunks_one_pass": timed(chunks_one_pass),
    }
    return {name: round(max(0.0, value), 3) for name, value in stages.items()}


def _first_touch_cold(nbytes: int) -> float:
    """CPU-s per GB a fresh process spends first touching `nbytes` of new float32 arrays (huge pages
    asked for, as numpy does), less rewriting them: the fragment arrays' first touch in a joiner."""
    script = ("import numpy as np, time\n"
              f"a = np.empty({nbytes // 4}, np.float32)\n"
              "t = time.process_time(); a.fill(1); fresh = time.process_time() - t\n"
              "t = time.process_time(); a.fill(2); again = time.process_time() - t\n"
              f"print((fresh - again) / {nbytes / 1e9})\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return float(out)


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
        # The receiver's CPU per GB by thread: the event loop (sockets, HTTP, asyncio) and the codec
        # pool (frames, hashes, decode into arrays, checks); and the pages it faulted in per GB
        # (4 KiB each unless huge: fresh memory the receive path touched)
        "receiver_threads_cpu_s_per_GB": {k: round(v / gb, 3) for k, v in result["threads_cpu_s"].items()},
        "receiver_page_faults_per_GB": round(result["page_faults"] / gb),
        "cpu_s": {"receiver": round(result["cpu_s"], 2), **{k: round(v, 2) for k, v in spent.items()}},
        # Cores the benchmark's processes kept busy on average over the download, of this machine's:
        # near the machine's count, the links are not what limits `utilization`, the CPU is
        "cores_busy": round((result["cpu_s"] + sum(spent.values())) / result["seconds"], 2),
        "cores": os.cpu_count(),
        # The receiver's CPU per GB by stage, each timed alone on one fragment (`receive_stages`)
        "receiver_stages_cpu_s_per_GB": receive_stages(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the global state")
    parser.add_argument("--fragments", type=int, default=24)
    parser.add_argument("--link-mbit", type=float, default=1000.0, help="cap of each of the 3 links")
    parser.add_argument("--cut-after", type=float, default=None, metavar="S", help="kill one link S seconds in")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stages", action="store_true",
                        help="print only the receiver's stage figures (no processes, no links)")
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
    if args.stages:
        print(json.dumps({"receiver_stages_cpu_s_per_GB": receive_stages()}, indent=2))
        return 0
    report = run_once(params, args.fragments, args.link_mbit, args.cut_after)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
