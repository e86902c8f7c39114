"""A node that cannot read or write its own files at start ends with one line naming the file and
the error, a documented exit status, and no traceback (issue 37 item 3).

One founder (a synthetic learner) runs until it wrote its coordination state and a checkpoint,
and stops. Each case restarts a copy of its data directory with one file broken: a directory
where the file should be (the read fails with EISDIR), a failpoint's I/O error, or the file cut
in half (damage at rest: quarantined, then refused or recovered as the store's rules say).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from diloco_node.daemon.exits import EXIT_CONFIG, EXIT_STORAGE
from diloco_node.storage import failpoints
from diloco_node.testbed.launcher import DEFAULT_SETTINGS, REPO, SiteSpec, run_until_checkpointed, write_secret

STARTUP_S = 180.0
# A hang guard, not a speed target (the tests assert no timing).
EXIT_WAIT_S = 120.0
SETTINGS = (*DEFAULT_SETTINGS, "learner=synthetic", "checkpoint_interval_s=1")


@pytest.fixture(scope="module")
def founded(tmp_path_factory) -> SiteSpec:
    """A founder's data directory with its coordination files and at least one checkpoint."""
    root = tmp_path_factory.mktemp("founder")
    spec = SiteSpec("a", root / "data", root / "a.log", write_secret(root / "secret"), settings=SETTINGS)
    run_until_checkpointed(spec, STARTUP_S)
    return spec


def _as_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _restart(spec: SiteSpec, tmp_path: Path, *, env: dict[str, str] | None = None, breaking=None,
             relative: str = "") -> tuple[int, str]:
    """Copy the founder's data, break one file there (`breaking(path)`), restart on it."""
    data = tmp_path / "data"
    shutil.copytree(spec.data_dir, data)
    if breaking is not None:
        breaking(data / relative)
    argv = SiteSpec("a", data, tmp_path / "a.log", spec.secret_file, settings=SETTINGS).argv()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=EXIT_WAIT_S,
                          env={**spec.child_env(), **(env or {})})
    return done.returncode, done.stderr


def _one_line_naming(stderr: str, name: str) -> str:
    assert "Traceback" not in stderr, stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("diloco-node run: ")]
    assert name in line, line
    return line


# Each of these ends before JAX is imported (daemon/start_check.py): a few seconds a case.
@pytest.mark.parametrize("relative", [
    "coordination/election.json",
    "coordination/election.copy.json",
    "coordination/log.bin",
    "coordination/log.mark.json",
    "coordination/vote_floor.bin",
    "coordination/identity.json",
    "history.jsonl",
])
def test_a_directory_where_a_file_should_be_ends_the_start_in_one_line(founded, tmp_path, relative) -> None:
    code, stderr = _restart(founded, tmp_path, breaking=_as_directory, relative=relative)
    line = _one_line_naming(stderr, relative.rsplit("/", 1)[-1])
    assert code == EXIT_STORAGE and "Is a directory" in line and "cannot listen" not in line


def test_a_checkpoint_that_is_a_directory_ends_the_start_in_one_line(founded, tmp_path) -> None:
    def every_checkpoint_a_directory(checkpoints: Path) -> None:
        for path in checkpoints.glob("ckpt-*.bin"):
            _as_directory(path)

    code, stderr = _restart(founded, tmp_path, breaking=every_checkpoint_a_directory, relative="checkpoints")
    line = _one_line_naming(stderr, "ckpt-")
    assert code == EXIT_STORAGE and "Is a directory" in line


@pytest.mark.parametrize("point, name", [("log.read", "log.bin"), ("identity.read", "identity.json"),
                                         pytest.param("checkpoint.read", "ckpt-", marks=pytest.mark.slow)])
def test_an_io_error_reading_a_file_at_start_ends_in_one_line(founded, tmp_path, point, name) -> None:
    code, stderr = _restart(founded, tmp_path, env={failpoints.ENV_VAR: f"{point}=eio"})
    line = _one_line_naming(stderr, name)
    assert code == EXIT_STORAGE and "Input/output error" in line


@pytest.mark.parametrize("relative", ["coordination/identity.json", "coordination/election.json+copy"])
def test_a_record_cut_in_half_is_quarantined_and_refused_in_one_line(founded, tmp_path, relative) -> None:
    """A checksummed record cut in half is damage, not an I/O error: kept aside, and the start
    refused with what to do (a node must not forget its identity or its vote)."""
    def cut(path: Path) -> None:
        if relative.endswith("+copy"):
            _cut_in_half(path.parent / "election.json")
            _cut_in_half(path.parent / "election.copy.json")
        else:
            _cut_in_half(path)

    code, stderr = _restart(founded, tmp_path, breaking=cut, relative=relative.removesuffix("+copy"))
    line = _one_line_naming(stderr, "identity.json" if "identity" in relative else "election")
    assert code == EXIT_CONFIG and "restore" in line


def test_the_daemon_returns_large_frees_to_the_system(founded) -> None:
    """ops/allocator.py ran in the real daemon, before its state was allocated (glibc here)."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert "allocator: blocks of 4 MiB or more are returned to the system when freed" in founded.log_path.read_text()
