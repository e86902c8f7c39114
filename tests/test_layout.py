"""The layout keeps its promises: no import cycles, the algorithm room (`diloco_node/sync/`) does
no I/O and reads no clock (nor do `wire/` and `bootstrap/`), and the rooms depend on each other in one direction only.

Imports are read from the source (`ast`), function-level ones included, so a cycle hidden in a
late import is found too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("diloco_node", "wire", "bootstrap")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


@functools.cache  # the source is parsed once per test process, not once per parametrized room
def _imported_names(module: str, path: Path) -> frozenset[str]:
    """Every dotted name `module` imports, resolved to absolute names."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(names)


def _internal(name: str) -> str | None:
    """The project module a dotted name lives in (the longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_internal(name) for name in _imported_names(module, path)}
        # Importing a package's submodule runs the package's __init__: not a dependency worth a cycle.
        graph[module] = frozenset(t for t in targets if t and t != module and not module.startswith(t + "."))
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


# Rooms and what each may not import. Lower rooms never reach up into the rooms that use them.
FORBIDDEN = {
    "diloco_node.sync": ("diloco_node.daemon", "diloco_node.transport", "diloco_node.learn", "diloco_node.sim",
                         "diloco_node.testbed", "diloco_node.cli", "diloco_node.ops"),
    "diloco_node.learn": ("diloco_node.daemon", "diloco_node.transport", "diloco_node.sim", "diloco_node.testbed",
                          "diloco_node.cli", "diloco_node.ops"),
    # The ground floor of storage (durable writes, failpoints, record framing): every room above
    # uses it, it uses none of them.
    "diloco_node.storage": ("diloco_node.config", "diloco_node.sync", "diloco_node.learn", "diloco_node.daemon",
                            "diloco_node.transport", "diloco_node.ops", "diloco_node.sim", "diloco_node.testbed",
                            "diloco_node.cli", "wire", "bootstrap"),
    "diloco_node.ops": ("diloco_node.daemon", "diloco_node.sim", "diloco_node.testbed", "diloco_node.cli"),
    "diloco_node.sim": ("diloco_node.daemon", "diloco_node.transport", "diloco_node.testbed", "diloco_node.cli"),
    "diloco_node.daemon": ("diloco_node.sim", "diloco_node.testbed", "diloco_node.cli"),
    "diloco_node.testbed": ("diloco_node.cli",),
    "wire": ("diloco_node", "bootstrap"),
    "bootstrap": ("diloco_node",),
}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_depend_one_way(room: str) -> None:
    wrong = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                   if module == room or module.startswith(room + ".")
                   for target in targets for banned in FORBIDDEN[room]
                   if target == banned or target.startswith(banned + "."))
    assert wrong == []


# The sans-IO rooms are pure: time comes in as arguments, bytes in and out as values. Two
# exceptions: reading the run secret's file (wire.auth.load_run_secret checks its permissions)
# and a thread-local cache of zstd contexts (wire.codecs.container; contexts are not thread-safe).
IO_AND_CLOCK = ("asyncio", "aiohttp", "socket", "time", "threading", "subprocess", "os", "stat", "pathlib",
                "shutil", "diloco_node.clock")
SANS_IO_ROOMS = ("diloco_node.sync", "wire", "bootstrap")
ALLOWED_IO = {"wire.auth": {"os", "stat", "pathlib", "pathlib.Path"}, "wire.codecs.container": {"threading"}}


@pytest.mark.parametrize("room", SANS_IO_ROOMS)
def test_sans_io_rooms_do_no_io_and_read_no_clock(room: str) -> None:
    wrong = sorted(f"{module} imports {name}" for module, path in MODULES.items()
                   if module == room or module.startswith(room + ".")
                   for name in _imported_names(module, path)
                   if any(name == banned or name.startswith(banned + ".") for banned in IO_AND_CLOCK)
                   and name not in ALLOWED_IO.get(module, ()))
    assert wrong == []


# The daemon reads time through its one injected `Clock` (diloco_node/clock.py) and sleeps on it,
# so any part runs on a FakeClock in a test: no module of daemon/ reaches for the host's clock or
# asyncio's sleep itself (a reference counts too: a default argument is a call waiting to happen).
HOST_TIME = {("asyncio", "sleep"), ("time", "time"), ("time", "monotonic")}


def _host_time_uses(source: str, filename: str) -> list[str]:
    """`asyncio.sleep`, `time.time` and `time.monotonic`, as attributes or imported names, with lines."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and (node.value.id, node.attr) in HOST_TIME):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in {"asyncio", "time"}:
            found += [(node.lineno, f"from {node.module} import {alias.name}")
                      for alias in node.names if (node.module, alias.name) in HOST_TIME]
    return [f"{filename}:{line} {what}" for line, what in sorted(found)]


def test_the_host_time_scan_finds_what_it_looks_for() -> None:
    planted = ("import asyncio, time\nfrom time import monotonic\n"
               "async def f(sleep=asyncio.sleep):\n    await asyncio.sleep(1)\n    return time.time()\n")
    assert _host_time_uses(planted, "x.py") == [
        "x.py:2 from time import monotonic", "x.py:3 asyncio.sleep", "x.py:4 asyncio.sleep", "x.py:5 time.time"]
    assert _host_time_uses("import time\nt = time.perf_counter()\nclock.sleep(1)\n", "y.py") == []


def test_the_daemon_reads_time_only_through_its_clock() -> None:
    daemon = ROOT / "diloco_node" / "daemon"
    found = [use for path in sorted(daemon.rglob("*.py"))
             for use in _host_time_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


# The relay's decisions (what to want, fetch, promise, give up) live in the sans-IO relay plane,
# where the coordination simulation checks them; the daemon only performs them. So the plane, and
# everything it imports in turn, does no I/O, reads no clock and reaches into no daemon or transport.
RELAY_DECISIONS = "bootstrap.relay_plane"
# Its named limits are defined there and nowhere else (a second copy would be a rule no checker runs).
RELAY_LIMITS = ("GIVE_UP_S", "PROMISE_TIMEOUTS", "PROMISE_BYTES_PER_S", "MAX_PROMISED_PAYLOADS",
                "MAX_PROMISED_ASKERS", "DEFAULT_RELAY_TIMEOUT_S")


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_relay_decisions_import_no_io_and_no_daemon() -> None:
    reached = _reachable(_graph(), RELAY_DECISIONS)
    assert {"bootstrap.relay_tree", "wire.errors"} <= reached  # the finder follows imports
    wrong = sorted(f"{module} imports {name}" for module in reached
                   for name in _imported_names(module, MODULES[module])
                   if any(name == banned or name.startswith(banned + ".")
                          for banned in (*IO_AND_CLOCK, "diloco_node")))
    assert wrong == []


def test_the_daemon_performs_the_relay_planes_decisions_and_keeps_no_limits_of_its_own() -> None:
    performed = {f"{RELAY_DECISIONS}.{action}" for action in ("PayloadRelay", "Fetch", "Serve", "WakeAt", "Release")}
    assert performed <= _imported_names("diloco_node.daemon.relays", MODULES["diloco_node.daemon.relays"])
    defined = sorted(f"{module} defines {target.id}" for module, path in MODULES.items()
                     if module != RELAY_DECISIONS
                     for node in ast.parse(path.read_text()).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(target, ast.Name) and target.id in RELAY_LIMITS)
    assert defined == []


# No daemon module grows past this many lines (split it by responsibility instead), and the
# composition root, node.py, is the lifecycle only: its parts are built elsewhere (services.py,
# parts.py), so it stays well under that.
DAEMON_MODULE_MAX_LINES = 600
NODE_MAX_LINES = 450


def test_no_daemon_module_is_longer_than_the_bound() -> None:
    long = sorted(f"{module}: {len(path.read_text().splitlines())} lines" for module, path in MODULES.items()
                  if module.startswith("diloco_node.daemon.")
                  and len(path.read_text().splitlines()) > DAEMON_MODULE_MAX_LINES)
    assert long == []
    assert len(MODULES["diloco_node.daemon.node"].read_text().splitlines()) <= NODE_MAX_LINES


# Admission (who may contribute, how many at a time, how much work) is the syncer's, decided without
# I/O, so the runner applies the daemon's rules. Named one by one: the room-wide rules above do not
# name the daemon's own packages, and this one would pass unnoticed if the module moved.
ADMISSION_MUST_NOT_IMPORT = ("asyncio", "aiohttp", "socket", "time", "os", "threading", "diloco_node.clock",
                             "diloco_node.daemon", "diloco_node.transport", "diloco_node.ops", "bootstrap")


def test_admission_lives_in_sync_and_imports_no_io() -> None:
    module = "diloco_node.sync.admission"
    assert module in MODULES
    imported = _imported_names(module, MODULES[module])
    wrong = sorted(name for name in imported for banned in ADMISSION_MUST_NOT_IMPORT
                   if name == banned or name.startswith(banned + "."))
    assert wrong == []


# Every fsync of the daemon goes through diloco_node/storage/durable.py, behind its failpoint, so a
# crash failpoint drops what was not fsynced (issue 26).
def test_every_fsync_goes_through_the_durable_module() -> None:
    calling = {str(path.relative_to(ROOT)) for path in MODULES.values()
               if "os.fsync(" in path.read_text() or "os.fdatasync(" in path.read_text()}
    assert calling == {"diloco_node/storage/durable.py"}
