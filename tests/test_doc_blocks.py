"""The fenced blocks of README.md and docs/*.md, read without running them: each names its
language, the command blocks are found, and what can be checked of the blocks that cannot run as
written (the convention: docs/ARCHITECTURE.md, "Command blocks in the docs";
tests/integration/test_doc_commands.py runs the command blocks)."""

from __future__ import annotations

import re

from diloco_node.config.settings import load_config
from diloco_node.testbed.launcher import REPO

from conftest import DOC_NOT_RUN, doc_blocks, doc_command_block

BLOCKS = doc_blocks()
COMMANDS = [b for b in BLOCKS if b.is_command]


def test_every_fenced_block_names_its_language():
    """An untagged block could hide a command from tests/integration/test_doc_commands.py: say
    `text` for output."""
    untagged = [b.name for b in BLOCKS if not b.language]
    assert untagged == [], f"fenced blocks without a language (use bash, text, toml, json, python): {untagged}"


def test_the_docs_have_command_blocks_of_each_kind():
    # The extraction itself must find something, or every check of the blocks would pass vacuously.
    run_now = [b for b in COMMANDS if b.run_by_tests == "now"]
    assert len(COMMANDS) >= 20 and len(run_now) >= 3 and any(b.run_by_tests == "slow" for b in COMMANDS)
    assert any(DOC_NOT_RUN.match(b.marker) for b in COMMANDS)
    assert {b.name.split(":")[0] for b in run_now} >= {"docs/BANDWIDTH.md", "docs/GOODPUT.md", "docs/OPERATIONS.md"}


UNIT = REPO / "examples" / "systemd" / "diloco-node.service"
COMMAND_WORD = re.compile(r"([^\s=]*)\bdiloco-node (run|config|status|watch|export|certs|evict|profile)\b")


def test_the_systemd_steps_call_diloco_node_by_the_units_absolute_path():
    """Neither the unit's PATH nor sudo's secure_path has the virtual environment: a bare
    `diloco-node` in the steps is not found, so every call names the unit's ExecStart binary."""
    exec_start = next(line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith("ExecStart="))
    binary = exec_start.split()[0]
    assert binary.startswith("/") and binary.endswith("/bin/diloco-node")
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    section = operations[operations.index("## Running under systemd"):operations.index("### Logs")]
    for where, text in (("docs/OPERATIONS.md", section), ("the unit's comments", UNIT.read_text())):
        calls = COMMAND_WORD.findall(text)
        assert calls, where
        assert {prefix for prefix, _ in calls} == {binary.removesuffix("diloco-node")}, (where, calls)
    steps = doc_command_block("docs/OPERATIONS.md", "systemctl enable --now diloco-node").text
    assert f"python3 -m venv {binary.removesuffix('/bin/diloco-node')}" in steps


def test_example_sites_keep_the_operator_routes_off_the_peer_port():
    """An example that listens on every address serves /status and /metrics on loopback only."""
    checked = 0
    for path in sorted((REPO / "examples" / "sites").glob("*.toml")):
        node = load_config(path, {}, {}).node
        if node.listen.is_wildcard:
            checked += 1
            operator = node.operator_listen
            assert operator is not None and operator.host == "127.0.0.1" and operator != node.listen, path.name
    assert checked >= 5
