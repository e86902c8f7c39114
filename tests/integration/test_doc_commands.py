"""Every command block in README.md and docs/*.md pastes (issue 28 item 10).

The convention (docs/ARCHITECTURE.md, "Command blocks in the docs"): every fenced block names its
language (tests/test_doc_blocks.py checks that, and what can be checked of the blocks that are not
run), and a `bash` block is either run here, as a new user would paste it, or preceded by a
marker that says why it cannot be:

    <!-- not run by tests: needs two hosts -->        never run (two hosts, systemd, a GPU, root, ...)
    <!-- run by tests: slow -->                       run only by `pytest -m slow`

An unmarked bash block is run in a fresh directory with `.venv/bin/diloco-node`, `.venv/bin/python`
(and plain `diloco-node`, `python`, `python3` on PATH) standing for this checkout, and the
repository's `examples/` and `benchmarks/` beside it. A block that fails fails its test, so a doc
cannot keep a command that no longer works, and a new block must be made to run or say why not.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_node.testbed.launcher import REPO, node_env

from conftest import doc_blocks, doc_command_block

pytestmark = pytest.mark.integration

BLOCK_TIMEOUT_S = 120
RUN_NOW = [b for b in doc_blocks() if b.run_by_tests == "now"]
RUN_SLOW = [b for b in doc_blocks() if b.run_by_tests == "slow"]


@pytest.fixture(scope="module")
def sandbox_bin(tmp_path_factory) -> Path:
    """`.venv/bin` as the docs assume it, standing for this checkout (not an installed copy)."""
    bin_dir = tmp_path_factory.mktemp("venv") / "bin"
    bin_dir.mkdir()
    # PYTHONPATH is set inside the shims: a block may set its own (PYTHONPATH=examples/...).
    path = shlex.quote(str(REPO))
    for name, run in (("diloco-node", f"{shlex.quote(sys.executable)} -m diloco_node"),
                      ("python", shlex.quote(sys.executable)), ("python3", shlex.quote(sys.executable))):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nPYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}} exec {run} "$@"\n')
        shim.chmod(0o755)
    (bin_dir / "activate").write_text(f'PATH={shlex.quote(str(bin_dir))}:"$PATH"\n')
    return bin_dir


def run_block(text: str, cwd: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    (cwd / ".venv").mkdir()
    (cwd / ".venv" / "bin").symlink_to(bin_dir)
    for shared in ("examples", "benchmarks"):
        (cwd / shared).symlink_to(REPO / shared)
    env = node_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    env.pop("PYTHONPATH")  # the shims add this checkout; the block's own PYTHONPATH must not be overridden
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.parametrize("block", RUN_NOW, ids=lambda b: b.name)
def test_a_command_block_runs(block, tmp_path, sandbox_bin):
    result = run_block(block.text, tmp_path, sandbox_bin)
    assert result.returncode == 0, (
        f"{block.name} failed (exit {result.returncode}). Fix the command, or mark the block with "
        f"'<!-- not run by tests: WHY -->'.\n--- block\n{block.text}--- stderr\n{result.stderr[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_SLOW, ids=lambda b: b.name)
def test_a_slow_command_block_runs(block, tmp_path, sandbox_bin):
    result = run_block(block.text, tmp_path, sandbox_bin)
    assert result.returncode == 0, f"{block.name} failed:\n{block.text}{result.stderr[-3000:]}"


def test_a_failing_block_fails(tmp_path, sandbox_bin):
    """The runner itself must not swallow errors, including a failing command mid-pipeline."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "good").mkdir()
    assert run_block("diloco-node --version\ndiloco-node no-such-command | cat\n", tmp_path / "bad", sandbox_bin).returncode
    ok = run_block("diloco-node --version\n", tmp_path / "good", sandbox_bin)
    assert ok.returncode == 0, ok.stderr


# --- a block that cannot run as written is checked in part --------------------------------------


def test_the_custom_model_run_line_has_what_run_needs(tmp_path, sandbox_bin):
    """docs/MODELS.md's custom-model block trains until stopped; with `config show` in place of
    `run`, the same lines must load the example config and find the run secret (without one,
    `run` exits 2)."""
    block = doc_command_block("docs/MODELS.md", "examples/sites/custom-model.toml")
    assert "diloco-node run " in block.text
    result = run_block(block.text.replace("diloco-node run ", "diloco-node config show "), tmp_path, sandbox_bin)
    assert result.returncode == 0, result.stderr
    assert "no run secret configured" not in result.stderr + result.stdout
    assert "my_lm:build" in result.stdout
    # The example config's own comment shows the same line.
    comment = (REPO / "examples" / "sites" / "custom-model.toml").read_text()
    assert "--secret-file secret" in comment
