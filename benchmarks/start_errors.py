"""Benchmark: how long `diloco-node run` takes to end on a state file it cannot read at start.

Founds one node (a synthetic learner) until it wrote its coordination state and a checkpoint,
stops it, then restarts a copy of its data directory once per case, each with one file broken,
and reports the wall time from the process's start to its exit, its exit status and its one line.
The target (issue 37): every such start error ends within 10 s. The coordination files are read
before JAX is imported (diloco_node/daemon/start_check.py); a checkpoint is read by the start
itself, after the import.

    .venv/bin/python benchmarks/start_errors.py
    .venv/bin/python benchmarks/start_errors.py --json start_errors.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco_node.storage import failpoints  # noqa: E402
from diloco_node.testbed.launcher import (  # noqa: E402
    DEFAULT_SETTINGS, REPO, SiteSpec, run_until_checkpointed, write_secret,
)

SETTINGS = (*DEFAULT_SETTINGS, "learner=synthetic", "checkpoint_interval_s=1")
STARTUP_S = 300.0  # a hang guard for the founder, not a figure
EXIT_WAIT_S = 300.0
TARGET_S = 10.0


def _as_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _checkpoints_as_directories(path: Path) -> None:
    for checkpoint in path.glob("ckpt-*.bin"):
        _as_directory(checkpoint)


# (name, file under the data directory, how it is broken, failpoints armed)
CASES = [
    ("election.json a directory", "coordination/election.json", _as_directory, ""),
    ("log.bin a directory", "coordination/log.bin", _as_directory, ""),
    ("history.jsonl a directory", "history.jsonl", _as_directory, ""),
    ("log.read=eio", "", None, "log.read=eio"),
    ("identity.read=eio", "", None, "identity.read=eio"),
    ("identity.json cut in half", "coordination/identity.json", _cut_in_half, ""),
    ("every checkpoint a directory", "checkpoints", _checkpoints_as_directories, ""),
]


def found(root: Path) -> SiteSpec:
    spec = SiteSpec("a", root / "data", root / "a.log", write_secret(root / "secret"), settings=SETTINGS)
    run_until_checkpointed(spec, STARTUP_S)
    return spec


def run_case(spec: SiteSpec, work: Path, relative: str, breaking, armed: str) -> dict:
    data = work / "data"
    shutil.copytree(spec.data_dir, data)
    if breaking is not None:
        breaking(data / relative)
    argv = SiteSpec("a", data, work / "a.log", spec.secret_file, settings=SETTINGS).argv()
    env = {**spec.child_env(), **({failpoints.ENV_VAR: armed} if armed else {})}
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=EXIT_WAIT_S, env=env)
    wall = time.monotonic() - started
    lines = [x for x in done.stderr.splitlines() if x.startswith("diloco-node run: ")]
    return {"exit": done.returncode, "wall_s": round(wall, 2), "line": lines[0] if lines else "",
            "one_line": len(lines) == 1, "traceback": "Traceback" in done.stderr}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="start-errors-") as tmp:
        root = Path(tmp)
        spec = found(root / "founder")
        results = {}
        for index, (name, relative, breaking, armed) in enumerate(CASES):
            results[name] = result = run_case(spec, root / f"case-{index}", relative, breaking, armed)
            print(f"{name:32s} exit {result['exit']}  {result['wall_s']:6.2f} s  "
                  f"{'ok' if result['wall_s'] <= TARGET_S else 'OVER ' + str(TARGET_S) + ' s'}  {result['line']}",
                  flush=True)
    worst = max(r["wall_s"] for r in results.values())
    print(f"slowest: {worst:.2f} s (target {TARGET_S:.0f} s); every case one line, no traceback: "
          f"{all(r['one_line'] and not r['traceback'] for r in results.values())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
