"""`diloco-node eval`: score a model (a data directory's global model, an export, or a Hugging
Face Llama directory) on a site's eval sets, on fixed windows (ops/evaluate.py does the work).

Exit 0 on success; 2 with a one-line message for a PATH that is no model, a model whose
vocabulary is smaller than the data's ids, a config without eval data (a witness, or a set too
small for one window), or a config that does not load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TextIO

from diloco_node.config.settings import ConfigError, load_config
from diloco_node.ops.evaluate import EvalError, eval_streams, evaluate, load_model

DATA_CACHE_DIR = "data-cache"  # as the daemon's (daemon/site_model.py): tokenized text is reused, not redone


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--model", required=True, type=Path, metavar="PATH",
                        help="a node's data directory, an export file (diloco-node export) or a Hugging Face "
                             "Llama directory")
    parser.add_argument("--config", required=True, type=Path, metavar="SITE.toml",
                        help="the site config whose [node.data.eval.NAME] sets (else held-out slice) are scored")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="score only the windows within each set's first N tokens (default: the whole set)")
    parser.add_argument("--json", action="store_true", help='print {"sets": {NAME: {"loss": ..., "tokens": ...}}}')


def run(args: argparse.Namespace) -> int:
    return eval_command(args.model, args.config, args.max_tokens, args.json, sys.stdout, sys.stderr)


def eval_command(model_path: Path, config_path: Path, max_tokens: int | None, as_json: bool, stdout: TextIO,
                 stderr: TextIO) -> int:
    def fail(message: str) -> int:
        print(f"diloco-node eval: {message}", file=stderr)
        return 2

    if max_tokens is not None and max_tokens < 2:
        return fail(f"--max-tokens {max_tokens}: must be at least 2 (one input and its next token)")
    try:
        config = load_config(config_path, os.environ)
    except ConfigError as error:
        return fail(f"--config {config_path}: {error}")
    if config.node.role == "witness":
        return fail(f"--config {config_path}: a witness reads no data, so it has no eval data; pass a learner "
                    "site's config")
    try:
        model = load_model(model_path, config.run.model.seq_len)
        streams = eval_streams(config.node.data, config.node.data_dir / DATA_CACHE_DIR)
        results = evaluate(model, streams, max_tokens)
    except EvalError as error:
        return fail(str(error))
    if as_json:
        print(json.dumps({"sets": {name: {"loss": r.loss, "tokens": r.tokens} for name, r in results.items()}}),
              file=stdout)
        return 0
    print(f"{model.source}, windows of {model.spec.seq_len} + 1 tokens:", file=stdout)
    for name, result in results.items():
        print(f"  {name}: loss {result.loss:.6f} over {result.tokens:,} tokens", file=stdout)
    return 0
