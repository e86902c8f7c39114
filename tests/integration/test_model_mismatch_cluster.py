"""A site whose model code differs from the run's is refused before it is admitted, with the
differing tensors named, and the run does not change; a run on a user's own model trains."""

from __future__ import annotations

import os
import textwrap

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, REPO
from diloco_node.testbed.local_cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
MODELS = '''
import os

from flax import nnx


class Small(nnx.Module):
    def __init__(self, vocab, width, rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.hidden = nnx.Linear(width, width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return self.head(nnx.relu(self.hidden(self.embed(tokens))))


def build(config, rngs):
    # The width comes from this site's environment: the "same" code built differently per site.
    return Small(config["vocab_size"], int(os.environ.get("SITE_MODEL_WIDTH", "16")), rngs)
'''
SETTINGS = tuple(s for s in DEFAULT_SETTINGS if not s.startswith("run.model.size")) + ("run.model.factory=site_models:build",)


def test_a_joiner_whose_model_differs_is_refused_before_admission(tmp_path) -> None:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "site_models.py").write_text(textwrap.dedent(MODELS))
    path = os.pathsep.join([str(modules), str(REPO)])
    with Cluster.create(tmp_path / "run") as cluster:
        a = cluster.add("a", settings=SETTINGS, env={"PYTHONPATH": path})
        cluster.wait_for("a ready and committing", lambda s: s.get("a", {}).get("ready", False)
                         and s["a"]["commit_index"] >= 3, STARTUP_S)
        members_before = {m["node_id"] for m in cluster.poll()["a"]["members"]}
        wider = cluster.add("wide", bootstrap=a, settings=SETTINGS, env={"PYTHONPATH": path, "SITE_MODEL_WIDTH": "24"})
        code = wider.wait(STARTUP_S)
        text = wider.log_text()
        assert code not in (0, None), text[-2000:]
        assert "differs from the run's" in text and "hidden/kernel: float32[24, 24] here, float32[16, 16] in the run" in text
        after = cluster.poll()["a"]
        assert {m["node_id"] for m in after["members"]} == members_before == {"a"}
        # The same code built the same way joins and trains.
        cluster.remove("wide")
        cluster.add("b", bootstrap=a, settings=SETTINGS, env={"PYTHONPATH": path})
        cluster.wait_for("b ready", lambda s: s.get("b", {}).get("ready", False), STARTUP_S)
