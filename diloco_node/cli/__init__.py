"""The `diloco-node` command line: a registry of subcommands, each in its own module.

Subcommand modules are imported lazily so that `diloco-node bandwidth` does not pay for
importing JAX. Each module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from diloco_node import __version__

# name -> (module implementing it, one-line help). Add a line per subcommand.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("diloco_node.cli.demo", "the main job on its built-in default: 4 local sites as real processes"),
    "train": ("diloco_node.cli.train", "an in-process multi-learner run with every knob exposed"),
    "simulate": ("diloco_node.cli.simulate", "fleet goodput under failures: dp, elastic dp, decoupled"),
    "bandwidth": ("diloco_node.cli.bandwidth", "cross-site bandwidth: data-parallel vs decoupled"),
    "status": ("diloco_node.cli.status", "one-shot status of one or more nodes (table or --json)"),
    "watch": ("diloco_node.cli.status", "live view of nodes' status; one JSON line per poll when piped"),
    "config": ("diloco_node.cli.config", "config show: the effective configuration and each value's source"),
    "chaos": ("diloco_node.cli.chaos", "seeded chaos run on local sites: kills, stops, partitions; checked histories"),
    "linkemu": ("diloco_node.cli.linkemu", "a WAN link emulator: TCP proxy with bandwidth cap and latency"),
    "run": ("diloco_node.cli.run", "run this site's daemon: found a run, or join one with --bootstrap"),
    "evict": ("diloco_node.cli.evict", "remove a site from this run for good (asks the local lease holder)"),
    "accept-loss": ("diloco_node.cli.accept_loss",
                    "let a node whose log lost entries vote again, recording who accepted the loss"),
    "profile": ("diloco_node.cli.profile", "a JAX profiler trace of N seconds of a running daemon (asks the local node)"),
    "certs": ("diloco_node.cli.certs", "a run CA and site certificates for mutual TLS: certs init|issue|revoke"),
    "export": ("diloco_node.cli.export", "write the global model from a site's newest verified checkpoint (safetensors or npz)"),
    "eval": ("diloco_node.cli.eval", "score a checkpoint, export or Hugging Face Llama on a site's eval sets"),
}


def version_line() -> str:
    """`diloco-node --version`: the package version and the Python it runs on (bug reports)."""
    return f"diloco-node {__version__} (Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco-node",
        description="Decoupled DiLoCo across sites: learners, a leased syncer, WAN-friendly sync.",
    )
    parser.add_argument("-V", "--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name, _command=name)
        # Arguments are added on demand (see main) so unrelated commands stay cheap to parse.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in ("-V", "--version"):  # answered here: argparse's action would exit
        print(version_line())
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints help / the error for an unknown command
        parser.print_help()
        return 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"diloco-node {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser, name)
    args = sub_parser.parse_args(argv[1:])
    args.command = name
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:
        # `diloco-node simulate | head`: the reader left; that is not an error of ours.
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
