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
