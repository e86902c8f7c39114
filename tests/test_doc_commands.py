"""Every command block in README.md and docs/*.md pastes (issue 28 item 10).

The convention (docs/ARCHITECTURE.md, "Command blocks in the docs"): every fenced block names its
language, and a `bash` block is either run here, as a new user would paste it, or preceded by a
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
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from diloco_node.config.settings import load_config
from diloco_node.testbed.launcher import node_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- not run by tests: (\S.*?) -->\s*$")
SLOW = re.compile(r"^\s*<!-- run by tests: slow -->\s*$")
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    marker: str  # the line before the fence

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j]) and not FENCE.match(lines[j])[2]),
                       None)
            assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: a fence that is never closed"
            indent = len(opening[1])
            text = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            found.append(Block(path, i + 1, opening[2], text, lines[i - 1] if i else ""))
            i = end + 1
    return found


BLOCKS = blocks()
COMMANDS = [b for b in BLOCKS if b.language in COMMAND_LANGUAGES]
RUN_NOW = [b for b in COMMANDS if not NOT_RUN.match(b.marker) and not SLOW.match(b.marker)]
RUN_SLOW = [b for b in COMMANDS if SLOW.match(b.marker)]


def test_every_fenced_block_names_its_language():
    """An untagged block could hide a command from the check below: say `text` for output."""
    untagged = [b.name for b in BLOCKS if not b.language]
    assert untagged == [], f"fenced blocks without a language (use bash, text, toml, json, python): {untagged}"


def test_the_docs_have_command_blocks_of_each_kind():
    # The extraction itself must find something, or every check here would pass vacuously.
    assert len(COMMANDS) >= 20 and len(RUN_NOW) >= 3 and RUN_SLOW
    assert any(NOT_RUN.match(b.marker) for b in COMMANDS)
    assert {b.name.split(":")[0] for b in RUN_NOW} >= {"docs/BANDWIDTH.md", "docs/GOODPUT.md", "docs/OPERATIONS.md"}


@pytest.fixture(scope="module")
def sandbox_bin(tmp_path_factory) -> Path:
    """`.venv/bin` as the docs assume it, standing for this checkout (not an installed copy)."""
    bin_dir = tmp_path_factory.mktemp("venv") / "bin"
    bin_dir.mkdir()
    # PYTHONPATH is set inside the shims: a block may set its own (PYTHONPATH=examples/...).
    path = shlex.quote(str(ROOT))
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
        (cwd / shared).symlink_to(ROOT / shared)
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


# --- the blocks that cannot run as written are checked in part ------------------------------------


def _block(doc: str, contains: str) -> Block:
    (found,) = [b for b in COMMANDS if b.name.startswith(doc) and contains in b.text]
    return found


def test_the_custom_model_run_line_has_what_run_needs(tmp_path, sandbox_bin):
    """docs/MODELS.md's custom-model block trains until stopped; with `config show` in place of
    `run`, the same lines must load the example config and find the run secret (without one,
    `run` exits 2)."""
    block = _block("docs/MODELS.md", "examples/sites/custom-model.toml")
    assert "diloco-node run " in block.text
    result = run_block(block.text.replace("diloco-node run ", "diloco-node config show "), tmp_path, sandbox_bin)
    assert result.returncode == 0, result.stderr
    assert "no run secret configured" not in result.stderr + result.stdout
    assert "my_lm:build" in result.stdout
    # The example config's own comment shows the same line.
    comment = (ROOT / "examples" / "sites" / "custom-model.toml").read_text()
    assert "--secret-file secret" in comment


UNIT = ROOT / "examples" / "systemd" / "diloco-node.service"
COMMAND_WORD = re.compile(r"([^\s=]*)\bdiloco-node (run|config|status|watch|export|certs|evict|profile)\b")


def test_the_systemd_steps_call_diloco_node_by_the_units_absolute_path():
    """Neither the unit's PATH nor sudo's secure_path has the virtual environment: a bare
    `diloco-node` in the steps is not found, so every call names the unit's ExecStart binary."""
    exec_start = next(line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    binary = exec_start.split()[0]
    assert binary.startswith("/") and binary.endswith("/bin/diloco-node")
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    section = operations[operations.index("## Running under systemd"):operations.index("### Logs")]
    for where, text in (("docs/OPERATIONS.md", section), ("the unit's comments", UNIT.read_text())):
        calls = COMMAND_WORD.findall(text)
        assert calls, where
        assert {prefix for prefix, _ in calls} == {binary.removesuffix("diloco-node")}, (where, calls)
    steps = _block("docs/OPERATIONS.md", "systemctl enable --now diloco-node").text
    assert f"python3 -m venv {binary.removesuffix('/bin/diloco-node')}" in steps


def test_example_sites_keep_the_operator_routes_off_the_peer_port():
    """An example that listens on every address serves /status and /metrics on loopback only."""
    checked = 0
    for path in sorted((ROOT / "examples" / "sites").glob("*.toml")):
        node = load_config(path, {}, {}).node
        if node.listen.is_wildcard:
            checked += 1
            operator = node.operator_listen
            assert operator is not None and operator.host == "127.0.0.1" and operator != node.listen, path.name
    assert checked >= 5
