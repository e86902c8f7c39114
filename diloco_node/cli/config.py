"""`diloco-node config show`: print the effective configuration and where each value came from.

Takes exactly the flags `run` takes (`config.add_run_flags`), so what it prints is what `run`
would use. Exit 0 when the configuration is valid, 2 with the error otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

from diloco_node.config.settings import ConfigError, EffectiveConfig, HostPort, add_run_flags, load_config_from_args


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print every effective value with its source (and validate)",
                              description="Print every effective value with its source. Exit 2 if invalid.")
    add_run_flags(show)
    show.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    return show_command(args, os.environ, sys.stdout, sys.stderr)


def show_command(args: argparse.Namespace, environ: Mapping[str, str], out: TextIO, err: TextIO) -> int:
    try:
        config = load_config_from_args(args, environ)
    except ConfigError as exc:
        print(f"diloco-node config: error: {exc}", file=err)
        return 2
    for warning in config.warnings:
        print(f"diloco-node config: warning: {warning}", file=err)
    if args.json:
        print(json.dumps(as_json(config), indent=2), file=out)
    else:
        print(render_text(config), file=out)
    return 0


def _plain(value: Any) -> Any:
    if isinstance(value, (Path, HostPort)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _display(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(_plain(v)) for v in value) if value else "(none)"
    return str(_plain(value))


def as_json(config: EffectiveConfig) -> dict[str, Any]:
    return {
        "config_file": None if config.config_file is None else str(config.config_file),
        "settings": [{"key": s.key, "value": _plain(s.value), "source": s.source, "env": s.env}
                     for s in config.settings()],
        "run_manifest_digest": config.run.digest(),
        "warnings": list(config.warnings),
    }


def render_text(config: EffectiveConfig) -> str:
    settings = config.settings()
    rows = [("KEY", "VALUE", "SOURCE")] + [(s.key, _display(s.value), s.source) for s in settings]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"config file: {config.config_file or '(none)'}",
             f"run manifest digest: {config.run.digest()}", ""]
    lines += [f"{key.ljust(widths[0])}  {value.ljust(widths[1])}  {source}" for key, value, source in rows]
    return "\n".join(lines)
