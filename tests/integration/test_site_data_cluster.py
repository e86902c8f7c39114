"""Data belongs to the site: real daemons each train on their own text files tokenized with a local
tokenizer.json; the founder seals the tokenizer's digest, a joiner with another tokenizer is
refused before it is admitted (the run unchanged), and one with the same tokenizer joins."""

from __future__ import annotations

import hashlib

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

from conftest import TOKENIZER_WORDS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0


def site_settings(text_file, tokenizer) -> tuple[str, ...]:
    return DEFAULT_SETTINGS + ("data.source=text", f"data.paths={text_file}", f"data.tokenizer={tokenizer}")


def test_sites_tokenize_their_own_text_and_a_different_tokenizer_is_refused(tmp_path, word_tokenizer,
                                                                            word_text) -> None:
    ours = word_tokenizer(tmp_path / "tokenizer.json")
    theirs = word_tokenizer(tmp_path / "other-tokenizer.json", TOKENIZER_WORDS[:12])
    digest = hashlib.sha256(ours.read_bytes()).hexdigest()
    for name, seed in (("a", 0), ("b", 1), ("x", 2)):
        word_text(tmp_path / f"{name}.txt", 6_000, seed=seed)  # every site its own file
    with Cluster.create(tmp_path / "run") as cluster:
        a = cluster.add("a", settings=site_settings(tmp_path / "a.txt", ours))
        cluster.wait_for("a ready and committing", lambda s: s.get("a", {}).get("ready", False)
                         and s["a"]["commit_index"] >= 3, STARTUP_S)
        members_before = {m["node_id"] for m in cluster.poll()["a"]["members"]}
        other = cluster.add("x", bootstrap=a, settings=site_settings(tmp_path / "x.txt", theirs))
        code = other.wait(STARTUP_S)
        text = other.log_text()
        assert code not in (0, None), text[-2000:]
        assert f"is not the run's tokenizer (sha256 {digest})" in text, text[-2000:]
        assert {m["node_id"] for m in cluster.poll()["a"]["members"]} == members_before == {"a"}
        cluster.remove("x")
        # The same tokenizer over another file joins, and its learner trains on it.
        cluster.add("b", bootstrap=a, settings=site_settings(tmp_path / "b.txt", ours))
        cluster.wait_for("b ready and training", lambda s: s.get("b", {}).get("ready", False)
                         and (s["b"].get("learner") or {}).get("step", 0) > 0, STARTUP_S)
        b_log = cluster.sites["b"].log_text()
        assert "b.txt" in b_log and "tokenized by" in b_log
