"""Test-wide setup and the helpers tests share.

Before JAX initialises: two host CPU devices (tests of data-parallel learners need several), XLA's
backend at its lowest optimisation level (compiling is most of these tests' time), and the
persistent compilation cache the test nodes already use, so a second run of the suite skips
most of XLA's compile time (the in-process learner tests are mostly compiling).

The layout (README.md, "Run the tests"): a test that starts another process lives under
tests/integration/ and is marked `integration` here, whatever its module says; every other test
runs in the pytest process and lives in tests/. Tests marked `slow` or `browser` run only when the
`-m` expression names their marker, so `-m 'not integration'` (the fast loop) leaves them out too.
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from diloco_node.testbed.launcher import JAX_CACHE, REPO  # imports no JAX: the setup below comes first

# LLVM at -O0 for the in-process tests: they check what programs compute, never how fast, and
# most of their CPU is XLA compiling small programs once (a third less for test_attention.py,
# measured from a cold cache). Test nodes (testbed/launcher.py) keep the default level.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", JAX_CACHE)
# The learners' programs are small, each under JAX's default 1 s threshold: cache them all.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import pytest  # noqa: E402 - after the environment JAX reads at import

INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"
# Markers whose tests run only when the -m expression names them (not by `-m 'not integration'`).
OPT_IN_MARKERS = ("slow", "browser")


@pytest.fixture
def clean_storage_state():
    """Failpoints disarmed and the storage-health record empty, before and after the test: both
    are process-wide, so a test that arms one or records a failure must not leave it to the next
    (a module opts in with `pytestmark = pytest.mark.usefixtures("clean_storage_state")`)."""
    from diloco_node.ops.storage_health import STORAGE
    from diloco_node.storage import failpoints

    failpoints.disarm()
    STORAGE.reset()
    yield
    failpoints.disarm()
    STORAGE.reset()


@pytest.hookimpl(tryfirst=True)  # before -m selects: it must see the integration marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION_DIR in item.path.parents:
            item.add_marker(pytest.mark.integration)
    expression = config.getoption("markexpr") or ""
    opted_out = [m for m in OPT_IN_MARKERS if not re.search(rf"\b{m}\b", expression)]
    deselected = [item for item in items if any(item.get_closest_marker(m) for m in opted_out)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        kept = set(map(id, items)) - set(map(id, deselected))
        items[:] = [item for item in items if id(item) in kept]


# Words of the small tokenizers tests make (id 0 is "[UNK]", word i is id i + 1).
TOKENIZER_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
                   "sigma tau upsilon phi chi psi omega").split()


@pytest.fixture
def word_tokenizer():
    """Makes a word-level tokenizer.json (with the `tokenizers` library; nothing is downloaded):
    `word_tokenizer(path, words=TOKENIZER_WORDS) -> path`."""
    def make(path, words=TOKENIZER_WORDS):
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"[UNK]": 0} | {word: i + 1 for i, word in enumerate(words)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.save(str(path))
        return path
    return make


@pytest.fixture
def word_text():
    """Writes random lines of TOKENIZER_WORDS: `word_text(path, words_count, seed=0) -> the text`."""
    def write(path, count, seed=0):
        import numpy as np

        rng = np.random.default_rng(seed)
        text = "\n".join(" ".join(rng.choice(TOKENIZER_WORDS, 12)) for _ in range(count // 12)) + "\n"
        path.write_text(text)
        return text
    return write


FINAL_LINE = re.compile(r"stopped cleanly at index (\d+) digest ([0-9a-f]+)")
COMPLETE_LINE = re.compile(r"the run is complete at commit (\d+)")


def one_final_state(logs: dict[str, str]) -> tuple[int, str]:
    """Every site saw the run complete at the same commit and stopped with the same state. A site
    may stop past that commit: a membership or new-epoch entry the lease holder commits while
    lingering changes no state, and a follower that stopped first need not have applied it."""
    completed = {name: int(COMPLETE_LINE.findall(text)[-1]) for name, text in logs.items()}
    finals = {name: FINAL_LINE.findall(text)[-1] for name, text in logs.items()}
    assert len(set(completed.values())) == 1, completed
    assert len({digest for _, digest in finals.values()}) == 1, finals
    assert all(int(index) >= completed[name] for name, (index, _) in finals.items()), (completed, finals)
    return next(iter(completed.values())), next(iter(finals.values()))[1]


class InlineExecutor:
    """An executor that runs work at once on the caller's thread: the order of events is the
    test's alone (RoundDriver and friends take any `concurrent.futures.Executor`)."""

    def submit(self, fn, /, *args, **kwargs):
        from concurrent.futures import Future

        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class NullCounter:
    """A metrics counter that counts nothing (for parts that take one)."""

    def inc(self, amount: float = 1.0) -> None:
        pass


@pytest.fixture
def restore_root_logger():
    """Tests that configure logging leave the root logger as they found it."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_status(port: int) -> dict | None:
    """The /status document of the node whose operator routes are on 127.0.0.1:`port`, or None
    while it does not answer (not started yet, or gone)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as response:
            return json.loads(response.read())
    except (OSError, ValueError):  # urllib.error.URLError is an OSError
        return None


def voters(status: dict) -> set[str]:
    """The voters a /status document lists."""
    return {m["node_id"] for m in status.get("members", ()) if m.get("voter")}


def all_ready(names: set[str]):
    """A `Cluster.wait_for` condition: every one of `names` reports ready."""
    return lambda statuses: names <= {n for n, d in statuses.items() if d.get("ready")}


def small_replica(outer=None):
    """A replica of two tensors (4x4 and 4) in two fragments, the same every call; `outer` is its
    OuterOptimizer (default: the manifest's)."""
    import numpy as np

    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(4, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 4, 1)
    return Replica(plan, initial, outer or OuterOptimizer())


def replica_with_rounds(shapes: dict, rng, rounds: int = 2):
    """(plan, replica): one fragment over `shapes`, random initial values from `rng`, and `rounds`
    small outer steps already applied to it (rounds a stale contribution is rebased from)."""
    import numpy as np

    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    plan = plan_fragments(shapes, 1, 2, 0)
    replica = Replica(plan, {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
                      OuterOptimizer())
    for _ in range(rounds):
        replica.state.apply_outer_gradient(0, {n: (1e-3 * rng.standard_normal(s)).astype(np.float32)
                                               for n, s in shapes.items()})
    return plan, replica


def byte_batches(rng, m: int):
    """Random token ids in [0, 256) for `m` stacked learners of 2 windows of 16: (inputs, targets),
    each of shape (m, 2, 16), the targets the inputs shifted by one."""
    import numpy as np

    x = rng.integers(0, 256, (m, 2, 17)).astype(np.int32)
    return x[..., :-1], x[..., 1:]


def vote_request(epoch: int = 3):
    """A vote request from candidate "a" (the message the transport tests send)."""
    from wire.messages import VoteRequest

    return VoteRequest(epoch=epoch, candidate="a", last_log_epoch=2, last_log_index=10)


class NoDisk:
    """The coordination store and history a `CoordinationIO` writes to, writing nothing."""

    damaged_after = None  # the store's: its log was not found damaged at load

    def sync(self, persistent, prepared=None) -> None:
        pass

    def observe(self, core) -> None:
        pass


async def serve_peer_server(server, ssl_context=None):
    """`server` (a transport `PeerServer`) listening on 127.0.0.1 at a free port: (runner, port);
    the caller cleans the runner up."""
    from aiohttp import web

    app = web.Application()
    server.install(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    return runner, runner.addresses[0][1]


def node_config(**changes):
    """A valid `NodeConfig` of site "a" on 127.0.0.1:7070, with `changes`."""
    from diloco_node.config.settings import HostPort, NodeConfig

    return NodeConfig(node_id="a", listen=HostPort("127.0.0.1", 7070), advertise="http://127.0.0.1:7070",
                      **changes)


def write_node_toml(tmp_path, text: str):
    """tmp_path/node.toml: a [node] table listening on 127.0.0.1:7300, then `text`."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\nlisten = "127.0.0.1:7300"\n' + text)
    return path


def process_gone(pid: int) -> bool:
    """No such process, or a zombie awaiting an init that does not reap (containers)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def eventually(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    """Whether `predicate()` holds within `timeout_s` (polled every `interval_s`): a test waits for
    what it asserts, `assert eventually(lambda: ...)`, rather than for something else."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


async def until(condition, timeout_s: float = 5.0) -> None:
    """Awaits `condition()` being true, polling every 10 ms; TimeoutError after `timeout_s`."""
    import asyncio

    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def _echo(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port():
    """An asyncio TCP server on 127.0.0.1 that echoes every byte back; its port."""
    import asyncio

    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def roundtrip(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """`payload` sent to 127.0.0.1:`port` on a new connection, and as many bytes read back."""
    import asyncio

    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(payload)
            await writer.drain()
            return await reader.readexactly(len(payload))
        finally:
            writer.close()


def config_show(argv: list[str], environ: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`diloco-node config show ARGV` in-process with `environ` as its environment: (exit code,
    stdout, stderr)."""
    import argparse
    import io

    from diloco_node.cli import config as config_cli

    parser = argparse.ArgumentParser()
    config_cli.add_arguments(parser, "config")
    args = parser.parse_args(["show", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = config_cli.show_command(args, environ or {}, out, err)
    return code, out.getvalue(), err.getvalue()


# ---- the fenced blocks of README.md and docs/*.md --------------------------------------------
# tests/integration/test_doc_commands.py runs the command blocks; tests/test_doc_blocks.py checks
# the rest of the convention (docs/ARCHITECTURE.md, "Command blocks in the docs").

DOC_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
DOC_COMMAND_LANGUAGES = {"bash", "sh", "shell", "console"}
DOC_NOT_RUN = re.compile(r"^\s*<!-- not run by tests: (\S.*?) -->\s*$")
DOC_SLOW = re.compile(r"^\s*<!-- run by tests: slow -->\s*$")


@dataclass(frozen=True)
class DocBlock:
    path: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str
    marker: str  # the line before the fence

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.language in DOC_COMMAND_LANGUAGES

    @property
    def run_by_tests(self) -> str | None:
        """"now" (in the default suite), "slow" (by `pytest -m slow`), or None: not a command, or
        marked as not run."""
        if not self.is_command or DOC_NOT_RUN.match(self.marker):
            return None
        return "slow" if DOC_SLOW.match(self.marker) else "now"


def doc_blocks() -> list[DocBlock]:
    """Every fenced block of README.md and docs/*.md, in order."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = DOC_FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines))
                        if DOC_FENCE.match(lines[j]) and not DOC_FENCE.match(lines[j])[2]), None)
            assert end is not None, f"{path.relative_to(REPO)}:{i + 1}: a fence that is never closed"
            indent = len(opening[1])
            text = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            found.append(DocBlock(path, i + 1, opening[2], text, lines[i - 1] if i else ""))
            i = end + 1
    return found


def doc_command_block(doc: str, contains: str) -> DocBlock:
    """The one command block of `doc` (a path from the repository root) whose text has `contains`."""
    (found,) = [b for b in doc_blocks() if b.is_command and b.name.startswith(doc) and contains in b.text]
    return found
