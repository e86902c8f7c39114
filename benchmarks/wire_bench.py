"""Benchmark of the wire path: codec speed, streamed transfer throughput, and memory of both ends.

Sections of the JSON report (`--json PATH`):
- "codecs": per codec, encode/decode MB/s of fp32 input on one core and the size ratio
  (from benchmarks/codec_bench.measure_codecs).
- "transfer": a 64 MB fragment streamed over loopback directly (`direct_MBps`) and through the link
  emulator capped at 200 Mbit/s (`capped_utilization` = achieved / cap; target >= 0.9); and the peak
  RSS of sender and receiver during a 256 MB transfer, each its own process (target: growth < 64 MB).

Sender, receiver and link emulator run as separate processes (this file with `--role`, and
`diloco-node linkemu`), so each one's memory is its own. MB = 10^6 bytes throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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
CHUNK_BYTES = 1 << 20  # the sender's payload iterator yields 1 MiB chunks
FRAGMENT_BYTES = 64 * CHUNK_BYTES
MEMORY_RUN_BYTES = 256 * CHUNK_BYTES
CAP_MBIT = 200.0
RUN_ID = "bench-wire"
BENCH_SECRET = b"benchmark-secret-not-for-production"  # loopback only


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _auth(node: str):
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key

    key = derive_frame_key(BENCH_SECRET)
    return AuthContext(RUN_ID, node, key), FrameVerifier(RUN_ID, key)


# ---- receiver process ---------------------------------------------------------------------------


async def _receiver() -> None:
    from aiohttp import web

    from diloco_node.transport import PeerServer
    from wire.messages import MessageKind

    auth, verifier = _auth("receiver")
    server = PeerServer(auth, verifier)
    received = {"bytes": 0}

    class CountingSink:
        async def write(self, data: bytes) -> None:
            received["bytes"] += len(data)

        async def finish(self) -> None:
            return None

        async def abort(self, reason: str) -> None:
            print(f"receiver: stream aborted: {reason}", file=sys.stderr)

    async def open_sink(head: object, peer: object, length: int) -> CountingSink:
        return CountingSink()

    server.on_stream(MessageKind.FRAGMENT_CONTRIBUTION, open_sink)
    app = web.Application()
    server.install(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    baseline_kib = _rss_kib("VmRSS")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
    await stop.wait()
    await runner.cleanup()
    print(json.dumps({"received_bytes": received["bytes"], "baseline_rss_MB": baseline_kib * 1024 / MB,
                      "peak_rss_MB": _rss_kib("VmHWM") * 1024 / MB}), flush=True)


# ---- sender process -----------------------------------------------------------------------------


async def _sender(url: str, total: int) -> None:
    from diloco_node.transport import PeerClient
    from wire.messages import FragmentContribution

    block = os.urandom(CHUNK_BYTES)
    count = total // CHUNK_BYTES
    hasher = hashlib.sha256()
    for _ in range(count):
        hasher.update(block)
    digest = hasher.digest()

    async def payload():
        for _ in range(count):
            yield block  # the same block again: generating data is not what is measured

    head = FragmentContribution(fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1,
                                codec="int4-zstd", learner_id="sender", payload=b"")
    auth, verifier = _auth("sender")
    async with PeerClient(auth, verifier) as client:
        baseline_kib = _rss_kib("VmRSS")
        start = time.perf_counter()
        await client.send_stream(url, head, payload(), payload_length=count * CHUNK_BYTES, payload_sha256=digest)
        elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": count * CHUNK_BYTES, "seconds": elapsed,
                      "MBps": count * CHUNK_BYTES / elapsed / MB, "baseline_rss_MB": baseline_kib * 1024 / MB,
                      "peak_rss_MB": _rss_kib("VmHWM") * 1024 / MB}), flush=True)


# ---- orchestration ------------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)


def _transfer(total: int, *, cap_mbit: float | None = None) -> dict:
    """One transfer of `total` bytes between fresh sender and receiver processes (optionally via
    a capped link emulator process); returns the sender's and receiver's reports."""
    receiver = _spawn(__file__, "--role", "receiver")
    link = None
    try:
        port = json.loads(receiver.stdout.readline())["port"]
        if cap_mbit is not None:
            link = _spawn("-m", "diloco_node", "linkemu", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}",
                          "--bandwidth-mbit", str(cap_mbit))
            port = int(link.stdout.readline().split()[3].rsplit(":", 1)[1])
        sender = _spawn(__file__, "--role", "sender", "--url", f"http://127.0.0.1:{port}", "--bytes", str(total))
        sent = json.loads(sender.stdout.readline())
        sender.wait(60)
    finally:
        for proc in (link, receiver):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
    received = json.loads(receiver.stdout.readline())
    receiver.wait(30)
    if link is not None:
        link.wait(30)
    for proc in (receiver, link, sender):
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
    if received["received_bytes"] != total:
        raise RuntimeError(f"receiver got {received['received_bytes']} bytes of {total}")
    return {"sender": sent, "receiver": received}


def measure_transfer() -> dict:
    direct = max((_transfer(FRAGMENT_BYTES) for _ in range(2)), key=lambda r: r["sender"]["MBps"])
    capped = _transfer(FRAGMENT_BYTES, cap_mbit=CAP_MBIT)
    memory = _transfer(MEMORY_RUN_BYTES)
    cap_Bps = CAP_MBIT * 1e6 / 8
    s, r = memory["sender"], memory["receiver"]
    return {
        "direct_MBps": round(direct["sender"]["MBps"], 1),
        "capped_MBps": round(capped["sender"]["MBps"], 2),
        "cap_MBps": cap_Bps / MB,
        "capped_utilization": round(capped["sender"]["MBps"] * MB / cap_Bps, 3),
        "peak_rss_MB_sender": round(s["peak_rss_MB"], 1),
        "peak_rss_MB_receiver": round(r["peak_rss_MB"], 1),
        "rss_growth_MB_sender": round(s["peak_rss_MB"] - s["baseline_rss_MB"], 1),
        "rss_growth_MB_receiver": round(r["peak_rss_MB"] - r["baseline_rss_MB"], 1),
        "memory_run_bytes": MEMORY_RUN_BYTES,
        "fragment_bytes": FRAGMENT_BYTES,
    }


def measure_codec_section(num_elements: int, repeats: int) -> list[dict]:
    from benchmarks.codec_bench import measure_codecs

    rows = measure_codecs(num_elements, repeats)
    return [{"codec": row["codec"], "encode_MBps": round(row["encode_MBps"], 1),
             "decode_MBps": round(row["decode_MBps"], 1), "ratio": round(row["ratio"], 3)} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report to this file")
    parser.add_argument("--codec-elements", type=int, default=1 << 23, help="fp32 values per codec measurement")
    parser.add_argument("--codec-repeats", type=int, default=2)
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        asyncio.run(_receiver())
        return 0
    if args.role == "sender":
        asyncio.run(_sender(args.url, args.bytes))
        return 0
    report = {"codecs": [] if args.skip_codecs else measure_codec_section(args.codec_elements, args.codec_repeats),
              "transfer": measure_transfer()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
