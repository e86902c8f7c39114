"""Benchmark of the wire path: codec speed, streamed transfer throughput, and memory of both ends.

Sections of the JSON report (`--json PATH`):
- "codecs": per codec, encode/decode MB/s of fp32 input on one core (wall and CPU time), the size
  ratio, bytes per value and relative L2 error (from benchmarks/codec_bench.measure_codecs), on the
  heavy-tailed delta; union8 also on what it is for, a merged update of four topk2 contributions
  (dataset "sparse_union"), where the heavy-tailed delta only shows its dense fallback.
- "transfer": a 64 MB fragment streamed over loopback directly (`direct_MBps`) and through the link
  emulator capped at 200 Mbit/s (`capped_utilization` = achieved / cap; target >= 0.9); and the peak
  RSS of sender and receiver during a 256 MB transfer, each its own process (target: growth < 64 MB).
- "tls": the same 64 MB capped transfer with and without mutual TLS (`--tls`; `--tls-only` runs just
  this section), alternating plain and TLS runs `TLS_PAIRS` times; `tls_cost` = 1 - best TLS / best
  plain throughput (target <= 0.03), and the direct (uncapped) TLS throughput, which shows the
  encryption's CPU cost on this host.
- "contribution_memory" (`--contribution-memory`, or `--contribution-memory-only`): in one process,
  tracemalloc peaks of the lease holder receiving one int4 contribution of a fragment of
  `--contribution-params` parameters (default 100M) as one wire 2.0 frame (buffered, decoded whole)
  and as a wire 2.1 stream (chunk by chunk, kept encoded), and of merging K = 4 such contributions
  held decoded (as 2.0 did) or encoded (as now). MiB = 2^20 bytes in this section.

Sender, receiver and link emulator run as separate processes (this file with `--role`, and
`diloco-node linkemu`), so each one's memory is its own. MB = 10^6 bytes throughout.
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

import blake3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

MB = 1_000_000
CHUNK_BYTES = 1 << 20  # the sender's payload iterator yields 1 MiB chunks
FRAGMENT_BYTES = 64 * CHUNK_BYTES
MEMORY_RUN_BYTES = 256 * CHUNK_BYTES
CAP_MBIT = 200.0
RUN_ID = "bench-wire"
BENCH_SECRET = b"benchmark-secret-not-for-production"  # loopback only
# Plain/TLS capped runs alternate this many times, so drift on a shared host hits both alike.
TLS_PAIRS = 3


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


def _site_tls(tls_dir: Path | None, node: str):
    """The TLS contexts of `node` from a directory made by `_make_pki`, or None (plain HTTP)."""
    if tls_dir is None:
        return None
    from diloco_node.transport.tls import SiteTls, TlsFiles

    return SiteTls(TlsFiles(tls_dir / node / "site.crt", tls_dir / node / "site.key", tls_dir / "ca" / "ca.crt"))


def _make_pki(root: Path) -> Path:
    from diloco_node.ops import pki

    pki.init_ca(root / "ca", force=True)
    for node in ("sender", "receiver"):
        pki.issue_site(root / "ca", node, root / node, hosts=("127.0.0.1",), force=True)
    return root


async def _receiver(tls_dir: Path | None = None) -> None:
    from aiohttp import web

    from diloco_node.transport import PeerServer
    from wire.messages import MessageKind

    auth, verifier = _auth("receiver")
    tls = _site_tls(tls_dir, "receiver")
    server = PeerServer(auth, verifier, certified_senders=tls is not None)
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
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.server_context if tls is not None else None)
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


async def _sender(url: str, total: int, tls_dir: Path | None = None) -> None:
    from diloco_node.transport import PeerClient
    from wire.messages import FragmentContribution

    block = os.urandom(CHUNK_BYTES)
    count = total // CHUNK_BYTES
    hasher = blake3.blake3()
    for _ in range(count):
        hasher.update(block)
    digest = hasher.digest()

    async def payload():
        for _ in range(count):
            yield block  # the same block again: generating data is not what is measured

    head = FragmentContribution(fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1,
                                codec="int4-zstd", learner_id="sender", payload=b"")
    auth, verifier = _auth("sender")
    tls = _site_tls(tls_dir, "sender")
    async with PeerClient(auth, verifier, tls=tls) as client:
        baseline_kib = _rss_kib("VmRSS")
        start = time.perf_counter()  # the TLS handshake is inside the measured time
        await client.send_stream(url, head, payload(), payload_length=count * CHUNK_BYTES, payload_digest=digest,
                                 peer="receiver" if tls is not None else None)
        elapsed = time.perf_counter() - start
    print(json.dumps({"bytes": count * CHUNK_BYTES, "seconds": elapsed,
                      "MBps": count * CHUNK_BYTES / elapsed / MB, "baseline_rss_MB": baseline_kib * 1024 / MB,
                      "peak_rss_MB": _rss_kib("VmHWM") * 1024 / MB}), flush=True)


# ---- orchestration ------------------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)


def _transfer(total: int, *, cap_mbit: float | None = None, tls_dir: Path | None = None) -> dict:
    """One transfer of `total` bytes between fresh sender and receiver processes (optionally via
    a capped link emulator process, optionally over mutual TLS); returns both ends' reports."""
    tls_args = ["--tls-dir", str(tls_dir)] if tls_dir is not None else []
    receiver = _spawn(__file__, "--role", "receiver", *tls_args)
    link = None
    try:
        port = json.loads(receiver.stdout.readline())["port"]
        if cap_mbit is not None:
            link = _spawn("-m", "diloco_node", "linkemu", "--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{port}",
                          "--bandwidth-mbit", str(cap_mbit))
            port = int(link.stdout.readline().split()[3].rsplit(":", 1)[1])
        scheme = "https" if tls_dir is not None else "http"
        sender = _spawn(__file__, "--role", "sender", "--url", f"{scheme}://127.0.0.1:{port}", "--bytes", str(total),
                        *tls_args)
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


def measure_tls() -> dict:
    """The capped 64 MB transfer with and without mutual TLS, alternating; and TLS uncapped."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="wire-bench-tls-") as tmp:
        tls_dir = _make_pki(Path(tmp))
        plain, tls = [], []
        for _ in range(TLS_PAIRS):
            plain.append(_transfer(FRAGMENT_BYTES, cap_mbit=CAP_MBIT)["sender"]["MBps"])
            tls.append(_transfer(FRAGMENT_BYTES, cap_mbit=CAP_MBIT, tls_dir=tls_dir)["sender"]["MBps"])
        direct_tls = _transfer(FRAGMENT_BYTES, tls_dir=tls_dir)["sender"]["MBps"]
        direct_plain = _transfer(FRAGMENT_BYTES)["sender"]["MBps"]
    return {
        "capped_MBps_plain": [round(x, 2) for x in plain],
        "capped_MBps_tls": [round(x, 2) for x in tls],
        "best_capped_MBps_plain": round(max(plain), 2),
        "best_capped_MBps_tls": round(max(tls), 2),
        "tls_cost": round(1 - max(tls) / max(plain), 4),
        "direct_MBps_plain": round(direct_plain, 1),
        "direct_MBps_tls": round(direct_tls, 1),
        "cap_MBps": CAP_MBIT * 1e6 / 8 / MB,
        "fragment_bytes": FRAGMENT_BYTES,
    }


def measure_codec_section(num_elements: int, repeats: int) -> list[dict]:
    from benchmarks.codec_bench import measure_codecs

    rows = measure_codecs(num_elements, repeats)
    rows += measure_codecs(num_elements, repeats, codecs=("int4", "union8"), dataset="sparse_union")
    return [{"codec": row["codec"], "dataset": row["dataset"], "encode_MBps": round(row["encode_MBps"], 1),
             "decode_MBps": round(row["decode_MBps"], 1), "encode_cpu_MBps": round(row["encode_cpu_MBps"], 1),
             "decode_cpu_MBps": round(row["decode_cpu_MBps"], 1), "ratio": round(row["ratio"], 3),
             "bytes_per_value": round(row["bytes_per_value"], 5), "rel_l2_error": round(row["rel_l2_error"], 4)}
            for row in rows]


def measure_contribution_memory(params: int, k: int = 4) -> dict:
    """Receive path and merge memory for one fragment, whole-frame (2.0) against streamed (2.1)."""
    import gc
    import tracemalloc

    import numpy as np

    from diloco_node.sync.global_state import FragmentHistory
    from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions
    from wire.codecs import decode_named, encode_named
    from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for

    mib = 1 << 20
    side = 2048
    shapes = {f"blocks/{i}/w": (side, side) for i in range(max(1, round(params / side**2)))}
    fp32 = 4 * sum(a * b for a, b in shapes.values())

    def delta(seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {name: 0.01 * rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}

    def traced(fn):
        gc.collect()
        tracemalloc.start()
        started = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return out, peak, elapsed

    def streamed(values: dict):
        head = open_for(shapes, fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1, codec="int4",
                        learner_id="a", stream=bytes(16))
        chunks = list(contribution_chunks(head, values))  # the sender's work, before measuring

        def receive():
            assembler = ContributionAssembler(head, shapes)
            for chunk in chunks:
                assembler.add(chunk)
            return assembler.finish()
        return receive, len(chunks)

    first = delta(1)
    payload = encode_named(first, "int4")
    frame_bytes = len(payload)
    decoded, whole_peak, whole_s = traced(lambda: decode_named(payload, expected=shapes))
    receive, chunk_count = streamed(first)
    encoded, stream_peak, stream_s = traced(receive)
    del decoded, payload, first
    kept = [encoded] + [streamed(delta(10 + i))[0]() for i in range(1, k)]
    rng = np.random.default_rng(0)
    current = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    history = FragmentHistory(fragment=0, capacity=2)
    history.record(0, current)
    caps = ContributionCaps(1000, 1000)

    def merge(deltas):
        contributions = [Contribution(f"l{i}", 0, 0, d, 10, 5000) for i, d in enumerate(deltas)]
        return lambda: merge_contributions(contributions, current, history, caps=caps, embedding_names=[])
    _, merge_encoded_peak, merge_encoded_s = traced(merge(kept))
    as_decoded = [{name: e[name] for name in e} for e in kept]
    _, merge_decoded_peak, merge_decoded_s = traced(merge(as_decoded))
    return {
        "params": sum(a * b for a, b in shapes.values()), "fp32_mib": round(fp32 / mib, 1),
        "whole_frame": {"frame_mib": round(frame_bytes / mib, 1), "decode_peak_mib": round(whole_peak / mib, 1),
                        "held_mib": round(fp32 / mib, 1), "seconds": round(whole_s, 2)},
        "streamed": {"chunks": chunk_count, "transient_peak_mib": round(stream_peak / mib, 1),
                     "held_mib": round(encoded.encoded_bytes / mib, 1), "seconds": round(stream_s, 2)},
        "merge": {"k": k, "held_decoded_mib": round(k * fp32 / mib, 1),
                  "held_encoded_mib": round(sum(e.encoded_bytes for e in kept) / mib, 1),
                  "peak_from_decoded_mib": round(merge_decoded_peak / mib, 1), "seconds_from_decoded": round(merge_decoded_s, 1),
                  "peak_from_encoded_mib": round(merge_encoded_peak / mib, 1), "seconds_from_encoded": round(merge_encoded_s, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the report to this file")
    parser.add_argument("--codec-elements", type=int, default=1 << 23, help="fp32 values per codec measurement")
    parser.add_argument("--codec-repeats", type=int, default=2)
    parser.add_argument("--skip-codecs", action="store_true")
    parser.add_argument("--tls", action="store_true", help="add the TLS section: capped transfer with and without TLS")
    parser.add_argument("--tls-only", action="store_true", help="run only the TLS section")
    parser.add_argument("--contribution-memory", action="store_true",
                        help="add the contribution_memory section (receive path and merge, 2.0 vs 2.1)")
    parser.add_argument("--contribution-memory-only", action="store_true", help="run only that section")
    parser.add_argument("--contribution-params", type=int, default=100_000_000,
                        help="parameters of the fragment in the contribution_memory section")
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        asyncio.run(_receiver(args.tls_dir))
        return 0
    if args.role == "sender":
        asyncio.run(_sender(args.url, args.bytes, args.tls_dir))
        return 0
    if args.contribution_memory_only:
        report: dict = {"contribution_memory": measure_contribution_memory(args.contribution_params)}
    elif args.tls_only:
        report = {"tls": measure_tls()}
    else:
        report = {"codecs": [] if args.skip_codecs else measure_codec_section(args.codec_elements, args.codec_repeats),
                  "transfer": measure_transfer()}
        if args.tls:
            report["tls"] = measure_tls()
        if args.contribution_memory:
            report["contribution_memory"] = measure_contribution_memory(args.contribution_params)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
