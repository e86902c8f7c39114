"""Test-wide setup that must happen before JAX initialises.

Forces two host CPU devices (tests of data-parallel learners need several devices) and keeps
XLA from oversubscribing this machine's two cores when several JAX users run at once.
"""

import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402 - after the environment JAX reads at import

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


def small_replica():
    """A replica of two tensors (4x4 and 4) in two fragments, the same every call."""
    import numpy as np

    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.fragments import plan_fragments
    from diloco_node.sync.replica import Replica

    rng = np.random.default_rng(0)
    initial = {"w": rng.normal(size=(4, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 4, 1)
    return Replica(plan, initial, OuterOptimizer())


class NoDisk:
    """The coordination store and history a `CoordinationIO` writes to, writing nothing."""

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
