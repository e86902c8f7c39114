"""`diloco-node linkemu`: one WAN link emulator as a process of its own.

    diloco-node linkemu --listen 127.0.0.1:P --upstream 127.0.0.1:Q --bandwidth-mbit 200 --latency-ms 30

It prints one line, `linkemu listening on HOST:PORT -> UPSTREAM`, so a parent that asked for
port 0 learns the port, and runs until SIGINT or SIGTERM. The emulator is
`diloco_node.testbed.linkemu.LinkEmulator`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from diloco_node.testbed.linkemu import LinkEmulator


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def add_arguments(parser: argparse.ArgumentParser, name: str = "linkemu") -> None:
    parser.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0),
                        help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--upstream", type=_host_port, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--bandwidth-mbit", type=float, default=None, help="cap per direction, Mbit/s")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter on the latency")


async def _serve_until_signalled(args: argparse.Namespace) -> None:
    link = LinkEmulator(args.upstream[0], args.upstream[1], listen_host=args.listen[0], listen_port=args.listen[1])
    link.set_bandwidth_mbit(args.bandwidth_mbit)
    link.set_latency(args.latency_ms / 1000, args.jitter_ms / 1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with link:
        print(f"linkemu listening on {link.address} -> {args.upstream[0]}:{args.upstream[1]}", flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    asyncio.run(_serve_until_signalled(args))
    return 0
