"""`diloco-node profile`: a JAX profiler trace of N seconds of a running daemon, through its
operator listener (loopback only, like `diloco-node evict`).

The daemon writes the trace into `<data_dir>/profiles/<timestamp>/` and answers with that
directory once the capture is done; this prints it and how to open it. Uses urllib (stdlib): it
must start fast and never import JAX.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from diloco_node.cli.status import post_operator

# The node answers when the capture ends: the request waits that long plus this margin (the
# profiler's own start and stop, writing the trace files).
ANSWER_MARGIN_S = 60.0
DEFAULT_SECONDS = 5.0

EXIT_CAPTURED = 0
EXIT_NOT_DONE = 1


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--status", metavar="URL", required=True,
                        help="the local node's operator listener: status_listen with TLS (by default "
                             "http://127.0.0.1:<port+1>), the node's own port without")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, metavar="N",
                        help=f"how long to trace the running learner, 1 to 300 (default {DEFAULT_SECONDS:g})")


def run(args: argparse.Namespace) -> int:
    return profile_command(args.status, args.seconds, sys.stdout, sys.stderr)


def request_profile(url: str, seconds: float) -> tuple[int, dict[str, Any]]:
    """POST <url>/profile; (HTTP status, JSON answer). Unreachable or no answer: status 0."""
    # The node answers when the capture ends: wait that long plus the margin.
    return post_operator(url, "/profile", {"seconds": seconds}, max(0.0, seconds) + ANSWER_MARGIN_S)


def profile_command(url: str, seconds: float, out: TextIO, err: TextIO) -> int:
    status, answer = request_profile(url, seconds)
    if status == 200:
        print(answer["dir"], file=out)
        print(f"{len(answer.get('files', []))} file(s); open with: tensorboard --logdir {answer['dir']} "
              "(pip install tensorboard tensorboard-plugin-profile), or the .trace.json.gz in ui.perfetto.dev",
              file=err)
        return EXIT_CAPTURED
    print(f"diloco-node profile: {answer.get('error', f'HTTP {status}')}", file=err)
    return EXIT_NOT_DONE
