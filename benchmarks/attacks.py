"""Attacks on real `diloco-node run` processes on loopback, and the figures of issue 13.

A 2-learner run (sites a and b, started by `testbed.local_cluster`); a is the lease holder. Each
attack comes from other loopback addresses than the sites use, the way a stranger's traffic would:

1. slowloris: 64 streams with forged `X-Diloco-Sender` headers, each from its own source address,
   sending a well-formed frame prefix one byte per second and reconnecting when cut; against the
   follower, then against the lease holder. Commits per second at the lease holder during each
   window against an unattacked window of the same length; how long each admitted stream lived.
2. sender flood: 5,000 requests with new sender header values (bad frames) to the follower; its
   RSS before and after.
3. idle: 300 connections that send nothing to the follower; how long until each is closed.
4. bomb: a member's 33 KB contribution that decompresses to 1 GiB, three at once, to the lease
   holder; the holder's peak RSS growth (sampled every 10 ms) against the fragment's fp32 size.
5. claims: a non-member's contribution claiming 2^40 tokens (status and reason), and a member's
   contribution claiming 2^40 tokens (what the merge caps it to, from the holder's log).
6. stream bomb: the same decompression bomb inside a member's *streamed* contribution (wire 2.1,
   a ContributionOpen naming the fragment's real tensors, then one ContributionChunk whose codec
   message declares 2^28 values), three at once; the answers and the holder's peak RSS growth.
7. stream stall: a member opens a streamed contribution, sends one valid chunk and then nothing;
   how long the holder keeps the stream before cutting it, and whether commits go on meanwhile.

    python benchmarks/attacks.py --json attacks.json [--window 30]
    python benchmarks/attacks.py --json attacks.json --only stream     # 6 and 7 only

Figures depend on the machine and its load (two shared cores here): run it alone, report the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

from diloco_node.config.settings import load_config, run_id_for  # noqa: E402
from diloco_node.testbed.launcher import DEFAULT_SETTINGS  # noqa: E402
from diloco_node.testbed.local_cluster import Cluster  # noqa: E402
from diloco_node.transport import PeerClient, PeerRefused, SENDER_HEADER, kind_path  # noqa: E402
from wire.auth import AuthContext, FrameVerifier, derive_frame_key, load_run_secret  # noqa: E402
from wire.codecs.layout import DIM, FIXED_HEADER, NAME_LEN, NDIM  # noqa: E402
from wire.frames import encode_frame  # noqa: E402
from wire.contribution_stream import contribution_chunks, open_for  # noqa: E402
from wire.messages import ContributionChunk, FragmentContribution, MessageKind, VoteRequest  # noqa: E402

STARTUP_S = 300.0
GiB = 1 << 30


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def commits_over(cluster: Cluster, holder: str, window_s: float) -> float:
    """Commits per second the lease holder reports over `window_s`."""
    first = cluster.poll()[holder]["commit_index"]
    started = time.monotonic()
    time.sleep(window_s)
    last = cluster.poll()[holder]["commit_index"]
    return (last - first) / (time.monotonic() - started)


# ---- 1. slowloris ----------------------------------------------------------------------------


async def _slow_stream(host: str, port: int, address: str, sender: str, prefix: bytes, stop: asyncio.Event,
                       lifetimes: list[float], statuses: list[int]) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(address, 0))
        except OSError:
            await asyncio.sleep(0.5)
            continue
        opened = time.monotonic()
        try:
            writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n{SENDER_HEADER}: {sender}"
                         f"\r\nContent-Length: {len(prefix) + 4096}\r\n\r\n".encode())

            async def drip() -> None:
                for byte in prefix:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)

            dripping = asyncio.create_task(drip())
            line = b""
            try:
                waiter = asyncio.ensure_future(reader.readline())
                done, _ = await asyncio.wait({waiter, asyncio.ensure_future(stop.wait())},
                                             return_when=asyncio.FIRST_COMPLETED)
                if waiter in done:
                    line = waiter.result()
                else:
                    waiter.cancel()
            finally:
                dripping.cancel()
                await asyncio.gather(dripping, return_exceptions=True)
            if line:
                lifetimes.append(time.monotonic() - opened)
                statuses.append(int(line.split()[1]))
        except (OSError, ValueError, IndexError):
            pass
        finally:
            writer.close()


def slowloris(url: str, stop: threading.Event, result: dict, streams: int = 64) -> None:
    host, port = url.removeprefix("http://").split(":")
    prefix = encode_frame(VoteRequest(epoch=1, candidate="a", last_log_epoch=0, last_log_index=0),
                          AuthContext("run-x", "a", derive_frame_key(b"s" * 32)), now_unix=time.time(),
                          nonce=os.urandom(16), to="b")[:120]
    lifetimes: list[float] = []
    statuses: list[int] = []

    async def main() -> None:
        done = asyncio.Event()
        tasks = [asyncio.create_task(_slow_stream(host, int(port), f"127.0.1.{i + 1}", random.choice(["a", "b", f"x{i}"]),
                                                  prefix, done, lifetimes, statuses)) for i in range(streams)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    result.update(streams=streams, answered=len(statuses),
                  statuses={str(s): statuses.count(s) for s in sorted(set(statuses))},
                  max_lifetime_s=round(max(lifetimes), 2) if lifetimes else None,
                  p50_lifetime_s=round(float(np.median(lifetimes)), 2) if lifetimes else None)


def attack_window(cluster: Cluster, target: str, holder: str, window_s: float) -> dict:
    stop = threading.Event()
    result: dict = {"target": target}
    thread = threading.Thread(target=slowloris, args=(cluster.sites[target].url, stop, result))
    thread.start()
    time.sleep(2.0)  # streams in place
    try:
        rate = commits_over(cluster, holder, window_s)
        ready = cluster.poll()[target].get("ready")
    finally:
        stop.set()
        thread.join()
    result.update(commits_per_s=round(rate, 3), target_ready_during_attack=ready)
    return result


# ---- 2. sender flood, 3. idle connections -----------------------------------------------------


async def sender_flood(url: str, count: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    garbage = b"NOPE" + bytes(60)
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with sem:
            try:
                reader, writer = await asyncio.open_connection(host, int(port),
                                                               local_addr=(f"127.0.2.{i % 200 + 1}", 0))
            except OSError:
                return
            try:
                writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n"
                             f"{SENDER_HEADER}: s{i:07d}-{os.urandom(8).hex()}\r\nContent-Length: {len(garbage)}\r\n\r\n"
                             .encode() + garbage)
                line = await reader.readline()
                status = int(line.split()[1]) if line else 0
                statuses[status] = statuses.get(status, 0) + 1
            finally:
                writer.close()

    await asyncio.gather(*(one(i) for i in range(count)))
    return {str(k): v for k, v in sorted(statuses.items())}


async def idle_connections(url: str, count: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    opened = time.monotonic()
    conns = []
    for i in range(count):
        conns.append(await asyncio.open_connection(host, int(port), local_addr=(f"127.0.3.{i % 200 + 1}", 0)))
    closed_after: list[float] = []

    async def wait_closed(reader: asyncio.StreamReader) -> None:
        try:
            await reader.read()
        except OSError:
            pass
        closed_after.append(time.monotonic() - opened)

    try:
        await asyncio.wait_for(asyncio.gather(*(wait_closed(r) for r, _ in conns)), 120)
    except TimeoutError:
        pass
    for _, writer in conns:
        writer.close()
    return {"connections": count, "closed": len(closed_after),
            "max_open_s": round(max(closed_after), 2) if closed_after else None}


# ---- 4. bomb, 5. claims -----------------------------------------------------------------------


class _PeakRss:
    """The peak resident set of a process, sampled every 10 ms while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.base = pid, rss_bytes(pid)
        self.peak = self.base
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "_PeakRss":
        async def sample() -> None:
            while True:
                self.peak = max(self.peak, rss_bytes(self.pid))
                await asyncio.sleep(0.01)
        self._task = asyncio.create_task(sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, rss_bytes(self.pid))


def bomb_payload(name: str, elements: int) -> bytes:
    header = FIXED_HEADER.pack(b"DLTC", 1, 1, 1, 0, 0, 1)  # version 1, fp32, zstd, no block, one tensor
    raw = name.encode()
    header += NAME_LEN.pack(len(raw)) + raw + NDIM.pack(1) + DIM.pack(elements)
    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=elements * 4)
    zeros = bytes(1 << 22)
    body = b"".join(compressor.compress(zeros) for _ in range(elements * 4 // len(zeros))) + compressor.flush()
    return header + body


def fragment_shapes() -> tuple[dict[str, tuple[int, ...]], list[tuple[str, ...]], str]:
    from diloco_node.learn import factory
    from diloco_node.learn import model as model_lib
    from diloco_node.sync.fragments import plan_fragments

    overrides = dict(setting.split("=", 1) for setting in DEFAULT_SETTINGS if setting.startswith("run."))
    manifest = load_config(None, {}, overrides).run
    _, params = factory.init_params(manifest.model, 0)
    shapes = {n: a.shape for n, a in model_lib.flat_params(params).items()}
    plan = plan_fragments(shapes, manifest.sync.fragments, manifest.sync.period, manifest.sync.overlap)
    return shapes, [f.names for f in plan.fragments], manifest.sync.codec_up


async def member_client(secret_file: Path, node_id: str) -> PeerClient:
    secret = load_run_secret(secret_file)
    run_id = run_id_for(secret)
    key = derive_frame_key(secret)
    client = PeerClient(AuthContext(run_id, node_id, key), FrameVerifier(run_id, key, node_id=node_id))
    await client.start()
    return client


async def bombs(cluster: Cluster, holder: str, sender: str, count: int = 3) -> dict:
    shapes, fragments, codec = fragment_shapes()
    name = fragments[0][0]
    fragment_fp32 = 4 * sum(int(np.prod(shapes[n])) for n in fragments[0])
    payload = bomb_payload(name, GiB // 4)
    client = await member_client(cluster.secret_file, sender)
    outcomes: list[str] = []
    try:
        async with _PeakRss(cluster.sites[holder].pid) as rss:
            async def send() -> str:
                message = FragmentContribution(0, 0, 0, 8, 8 * 128, codec, sender, payload)
                try:
                    await client.send(cluster.sites[holder].url, message, peer=holder, deadline_s=60)
                    return "accepted"
                except PeerRefused as refused:
                    return f"{refused.status} {refused.reason[:160]}"
            outcomes = list(await asyncio.gather(*(send() for _ in range(count))))
            await asyncio.sleep(1.0)
    finally:
        await client.close()
    return {"payload_bytes": len(payload), "declared_decoded_bytes": GiB, "at_once": count,
            "answers": outcomes, "rss_growth_bytes": rss.peak - rss.base, "fragment_fp32_bytes": fragment_fp32}


async def claims(cluster: Cluster, holder: str, member: str) -> dict:
    shapes, fragments, codec = fragment_shapes()
    from wire.codecs import encode_named

    payload = encode_named({n: np.full(shapes[n], 1e-3, np.float32) for n in fragments[1]}, codec)
    out = {}
    stranger = await member_client(cluster.secret_file, "mallory")
    try:
        await stranger.send(cluster.sites[holder].url, FragmentContribution(1, 0, 0, 8, 2**40, codec, "mallory", payload),
                            peer=holder, deadline_s=30)
        out["non_member"] = "accepted"
    except PeerRefused as refused:
        out["non_member"] = f"{refused.status} {refused.reason}"
    finally:
        await stranger.close()
    return out


# ---- 6. stream bomb, 7. stream stall -----------------------------------------------------------


def _stream_open(fragment: int, shapes: dict, names: tuple[str, ...], codec: str, sender: str):
    return open_for({n: shapes[n] for n in names}, fragment=fragment, base_index=0, base_round=0, c_steps=8,
                    c_tokens=8 * 128, codec=codec, learner_id=sender, stream=os.urandom(16))


async def stream_bombs(cluster: Cluster, holder: str, sender: str, count: int = 3) -> dict:
    shapes, fragments, codec = fragment_shapes()
    head = _stream_open(0, shapes, fragments[0], codec, sender)
    # Bombs as the first chunk of the first tensor, where the open allows chunk_elements values:
    # 2^28 fp32 zeros (1 GiB decoded from ~33 KB: more bytes than the run's codec may spend on the
    # chunk's values, and the wrong codec), and 2^24 zeros in the run's own codec (64 MiB decoded
    # from a few KB: few enough bytes to pass the byte check, so the decode's bound must refuse it).
    from wire.codecs import encode_named

    name = head.tensors[0].name
    chunks = {
        "1024 MiB fp32": ContributionChunk(head.stream, 0, 0, bomb_payload(name, GiB // 4)),
        f"64 MiB {codec}": ContributionChunk(head.stream, 0, 0, encode_named(
            {"": np.zeros(1 << 24, np.float32)}, codec, zstd_level=19)),
    }
    client = await member_client(cluster.secret_file, sender)
    outcomes: list[str] = []
    try:
        async with _PeakRss(cluster.sites[holder].pid) as rss:
            async def send(bomb: ContributionChunk) -> str:
                async def frames():
                    yield head
                    yield bomb
                try:
                    await client.send_sequence(cluster.sites[holder].url, frames(), peer=holder, deadline_s=60)
                    return "accepted"
                except PeerRefused as refused:
                    return f"{refused.status} {refused.reason[:160]}"
            # one stream per member at a time (a second is refused 429): the bombs go in turn
            for label, bomb in chunks.items():
                for _ in range(count):
                    outcomes.append(f"{label} in {len(bomb.payload):,} bytes: {await send(bomb)}")
            await asyncio.sleep(1.0)
    finally:
        await client.close()
    return {"chunk_values_allowed": head.chunk_elements, "sent": count * len(chunks), "answers": outcomes,
            "rss_growth_bytes": rss.peak - rss.base}


async def stream_stall(cluster: Cluster, holder: str, sender: str) -> dict:
    shapes, fragments, codec = fragment_shapes()
    names = fragments[1]
    head = _stream_open(1, shapes, names, codec, sender)
    delta = {n: np.full(shapes[n], 1e-3, np.float32) for n in names}
    client = await member_client(cluster.secret_file, sender)
    status_before = cluster.poll()[holder].get("commit_index", 0)
    started = time.monotonic()

    async def frames():
        yield head
        yield next(contribution_chunks(head, delta))
        await asyncio.sleep(3600)  # and then nothing: the holder must cut the stream

    try:
        await client.send_sequence(cluster.sites[holder].url, frames(), peer=holder, deadline_s=600)
        answer = "accepted"
    except PeerRefused as refused:
        answer = f"{refused.status} {refused.reason[:160]}"
    except Exception as error:  # the holder closing the connection mid-body is an answer too
        answer = f"{type(error).__name__}: {str(error)[:160]}"
    finally:
        await client.close()
    held_s = time.monotonic() - started
    return {"answer": answer, "held_s": round(held_s, 2),
            "holder_commits_meanwhile": cluster.poll()[holder].get("commit_index", 0) - status_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--window", type=float, default=30.0, help="seconds per commit-rate window")
    parser.add_argument("--only", choices=("all", "stream"), default="all",
                        help="stream: only the attacks on streamed contributions (6 and 7)")
    args = parser.parse_args()
    report: dict = {"load_before": load_average(), "window_s": args.window}
    with tempfile.TemporaryDirectory(prefix="diloco-attacks-") as tmp, Cluster.create(Path(tmp)) as cluster:
        a = cluster.add("a")
        cluster.wait_for("a ready", lambda s: bool(s.get("a", {}).get("ready")), STARTUP_S)
        cluster.add("b", bootstrap=a)
        cluster.wait_for("a and b ready, a leads", lambda s: all(s.get(n, {}).get("ready") for n in "ab")
                         and s["a"].get("coordinator") == "a", STARTUP_S)
        time.sleep(5.0)
        holder, follower = "a", "b"
        report["stream_bomb"] = asyncio.run(stream_bombs(cluster, holder, follower))
        report["stream_stall"] = asyncio.run(stream_stall(cluster, holder, follower))
        if args.only == "all":
            run_single_frame_attacks(cluster, holder, follower, args.window, report)
        log = cluster.sites[holder].log_text()
        report["holder_log_tracebacks"] = log.count("Traceback")
        report["holder_log_refusal_lines"] = len(re.findall(r"refused .* with \d{3}", log))
        report["holder_log_refusals_by_status"] = dict(Counter(re.findall(r"refused .* with (\d{3})", log)))
        report["digests_agree"] = not cluster.conflicting_indices()
    report["load_after"] = load_average()
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def run_single_frame_attacks(cluster: Cluster, holder: str, follower: str, window_s: float, report: dict) -> None:
    """Attacks 1 to 5 (single-frame contributions and raw connections), written into `report`."""
    report["unattacked_commits_per_s"] = round(commits_over(cluster, holder, window_s), 3)
    report["slowloris_follower"] = attack_window(cluster, follower, holder, window_s)
    report["slowloris_holder"] = attack_window(cluster, holder, holder, window_s)
    report["unattacked_after_commits_per_s"] = round(commits_over(cluster, holder, window_s), 3)
    for key in ("slowloris_follower", "slowloris_holder"):
        report[key]["vs_unattacked"] = round(report[key]["commits_per_s"] / max(
            1e-9, min(report["unattacked_commits_per_s"], report["unattacked_after_commits_per_s"])), 3)
    pid = cluster.sites[follower].pid
    before = rss_bytes(pid)
    statuses = asyncio.run(sender_flood(cluster.sites[follower].url, 5000))
    time.sleep(2.0)
    report["sender_flood"] = {"requests": 5000, "statuses": statuses, "rss_before": before,
                              "rss_after": rss_bytes(pid), "rss_growth_bytes": rss_bytes(pid) - before,
                              "peers_in_status": sorted(cluster.poll()[follower].get("transport", {})
                                                        .get("peers", {}))}
    report["idle"] = asyncio.run(idle_connections(cluster.sites[follower].url, 300))
    report["bomb"] = asyncio.run(bombs(cluster, holder, follower))
    report["claims"] = asyncio.run(claims(cluster, holder, follower))


if __name__ == "__main__":
    main()
