"""Commands that must not load JAX (they start fast and run beside a node): each runs in a fresh
interpreter, which then has no `jax` module."""

import json
import os
import subprocess
import sys

import pytest

from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration


def test_config_command_does_not_import_jax():
    code = ("import sys; from diloco_node import cli; rc = cli.main(['config', 'show', '--json']); "
            "assert 'jax' not in sys.modules, 'jax imported'; "
            "from diloco_node.cli import status as status_cli; assert 'jax' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["settings"][0]["key"] == "node_id"


def test_simulate_and_bandwidth_do_not_import_jax(tmp_path):
    code = (
        "import sys; from diloco_node import cli; "
        f"cli.main(['simulate','--chips','20000','--learners','2','--expected-failures','200',"
        f"'--plot','none','--json',{str(tmp_path / 'x.json')!r}]); "
        "cli.main(['bandwidth','--paper']); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_export_imports_no_jax() -> None:
    """The command starts fast and can run beside a node without loading JAX."""
    code = ("import sys, diloco_node.ops.export, diloco_node.cli.export; "
            "sys.exit('jax' in sys.modules or 'flax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


def test_the_state_files_read_before_a_start_imports_no_jax() -> None:
    """`diloco-node run` reads the node's own files before the import (daemon/start_check.py): a
    start that cannot read them ends without waiting for JAX."""
    code = "import sys, diloco_node.daemon.start_check; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False, timeout=120).returncode == 0
