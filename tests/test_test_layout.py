"""The tests are laid out like the `integration` marker: a test that starts another process lives
under tests/integration/ (tests/conftest.py marks every test there), every other test runs in the
pytest process and lives in tests/, so the fast loop `-m 'not integration'` starts no process.
Tests marked `slow` or `browser` run only when `-m` names their marker (README.md, "Run the
tests").

Read from the source (`ast`): a module outside tests/integration/ may neither carry the
`integration` mark nor import what starts processes.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import INTEGRATION_DIR, pytest_collection_modifyitems

TESTS = Path(__file__).resolve().parent
# Every module of tests that runs in the pytest process (conftest.py adds the mark: not a test).
IN_PROCESS = sorted(p for p in TESTS.rglob("*.py") if INTEGRATION_DIR not in p.parents and p.name != "conftest.py")
# Importing any of these is starting processes: subprocesses, nodes, link emulators, supervisors.
STARTS_PROCESSES = {"subprocess", "multiprocessing", "diloco_node.testbed.local_cluster",
                    "diloco_node.testbed.chaos.supervisor", "diloco_node.testbed.launcher.launch_site",
                    "diloco_node.testbed.launcher.start_link", "diloco_node.testbed.chaos.harness.run_chaos"}


def _relative(path: Path) -> str:
    return str(path.relative_to(TESTS.parent))


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _marks_integration(tree: ast.AST) -> bool:
    """`pytest.mark.integration` (or `mark.integration`) anywhere: a decorator or a `pytestmark`."""
    return any(isinstance(node, ast.Attribute) and node.attr == "integration"
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark" for node in ast.walk(tree))


def test_both_folders_hold_tests():
    assert len([p for p in IN_PROCESS if p.name.startswith("test_")]) >= 50
    assert len(list(INTEGRATION_DIR.glob("test_*.py"))) >= 10
    assert not (INTEGRATION_DIR / "conftest.py").exists()  # `from conftest import` must mean tests/conftest.py


def test_no_test_outside_tests_integration_is_marked_integration():
    marked = [_relative(p) for p in IN_PROCESS if _marks_integration(ast.parse(p.read_text(), str(p)))]
    assert marked == [], f"integration tests belong under tests/integration/ (move them there): {marked}"


def test_no_test_outside_tests_integration_starts_a_process():
    starting = {_relative(p): sorted(_imports(ast.parse(p.read_text(), str(p))) & STARTS_PROCESSES)
                for p in IN_PROCESS}
    starting = {path: names for path, names in starting.items() if names}
    assert starting == {}, f"a test that starts a process is an integration test: move it under tests/integration/: {starting}"


def test_the_checks_above_can_fail():
    marked = ast.parse("import pytest\npytestmark = [pytest.mark.integration]\n")
    assert _marks_integration(marked) and not _marks_integration(ast.parse("@pytest.mark.slow\ndef f(): pass\n"))
    assert _imports(ast.parse("def f():\n    import subprocess\n")) & STARTS_PROCESSES
    assert _imports(ast.parse("from diloco_node.testbed.local_cluster import Cluster\n")) & STARTS_PROCESSES


class _Item:
    """What the collection hook reads of a pytest item."""

    def __init__(self, path: Path, *marks: str) -> None:
        self.path = path
        self.marks = set(marks)

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks.add(mark.name)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None


def _collect(markexpr: str) -> tuple[list[_Item], list[_Item]]:
    """The hook run on four items (a unit test, a slow one, an integration test, a browser one):
    (those kept, those deselected)."""
    items = [_Item(TESTS / "test_x.py"), _Item(TESTS / "test_x.py", "slow"),
             _Item(INTEGRATION_DIR / "test_y.py"), _Item(INTEGRATION_DIR / "test_y.py", "browser")]
    deselected: list[_Item] = []
    config = SimpleNamespace(getoption=lambda name: {"markexpr": markexpr}[name],
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    pytest_collection_modifyitems(config, items)
    return items, deselected


def test_the_hook_marks_tests_integration_by_folder_and_runs_slow_and_browser_only_when_named():
    kept, deselected = _collect("")
    assert [sorted(i.marks) for i in kept] == [[], ["integration"]]
    assert [sorted(i.marks) for i in deselected] == [["slow"], ["browser", "integration"]]
    kept, deselected = _collect("not integration")  # the fast loop: no slow test either
    assert [sorted(i.marks) for i in kept] == [[], ["integration"]] and len(deselected) == 2
    kept, _ = _collect("slow")  # -m then selects among them
    assert [sorted(i.marks) for i in kept] == [[], ["slow"], ["integration"]]
    kept, _ = _collect("browser or slow or not slow")
    assert len(kept) == 4
