"""Runner option keep_inflight_progress and the parity benchmark's manifest overrides (--set)."""

import os
import sys

import numpy as np
import pytest

from diloco_node.learn import data as data_lib
from diloco_node.sim import runner
from diloco_node.config.manifest import ConfigError, InnerOptimizer, ModelSpec, RunManifest, SyncSpec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import parity  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module")
def corpus():
    full = data_lib.load_corpus(data_lib.DataSpec())
    return data_lib.Corpus(full.train[:200_000], full.eval[:20_000], 256, "stdlib slice")


def _sync(corpus, keep: bool) -> runner._FragmentSync:
    manifest = RunManifest(
        model=ModelSpec("tiny", 16),
        inner=InnerOptimizer(batch_size=2, lr_peak=3e-3, warmup_steps=2, total_steps=STEPS),
        sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=1),
    )
    config = runner.RunnerConfig(manifest, "decoupled", 2, STEPS, eval_batches=1, eval_batch_size=2,
                                 keep_inflight_progress=keep)
    return runner._FragmentSync(config, runner._setup(config, corpus), None)


def _send_then_step_then_merge(sync: runner._FragmentSync, contributors: frozenset[str]):
    """Learner 0 sends fragment 1 after 3 steps, takes 2 more steps (simulated: +0.25 on every value),
    then the merge of fragment 1 (Theta + 1) is applied."""
    st = sync.learners[0]
    names = sync.plan.fragments[1].names
    st.c_steps[1], st.c_tokens[1] = 3, 96
    sync._send(st, 1, 0.0)
    local = sync.stack.get_flat(0, names)
    sync.stack.set_flat(0, {n: v + np.float32(0.25) for n, v in local.items()})
    st.c_steps[1], st.c_tokens[1] = 5, 160
    theta = {n: v + np.float32(1.0) for n, v in st.base_params[1].items()}
    sync._apply_merge(st, runner._MergeMsg(1, 1, theta, 0, 0.0, contributors))
    return st, theta, sync.stack.get_flat(0, names)


def test_keep_inflight_progress_carries_the_steps_since_the_send_and_their_counters(corpus):
    st, theta, after = _send_then_step_then_merge(_sync(corpus, keep=True), frozenset({"learner-0"}))
    for name, value in theta.items():
        np.testing.assert_allclose(after[name], value + np.float32(0.25), rtol=0, atol=1e-6)
    assert (st.c_steps[1], st.c_tokens[1]) == (2, 64)
    assert st.base_round[1] == 1


def test_default_overwrites_with_the_merged_fragment_and_resets_counters(corpus):
    st, theta, after = _send_then_step_then_merge(_sync(corpus, keep=False), frozenset({"learner-0"}))
    for name, value in theta.items():
        np.testing.assert_array_equal(after[name], value)
    assert (st.c_steps[1], st.c_tokens[1]) == (0, 0)


def test_parity_overrides_parse_json_values_and_reject_unknown_keys():
    overrides = parity.parse_overrides(["outer.lr=0.9", "sync.merge=mean", "inner.warmup_steps=60"])
    assert overrides == {"outer": {"lr": 0.9}, "sync": {"merge": "mean"}, "inner": {"warmup_steps": 60}}
    manifest = parity.with_overrides(parity.default_manifest(600, 0), overrides)
    assert (manifest.outer.lr, manifest.sync.merge, manifest.inner.warmup_steps) == (0.9, "mean", 60)
    with pytest.raises(ConfigError, match="unknown key"):
        parity.with_overrides(manifest, parity.parse_overrides(["outer.lrx=1"]))
    with pytest.raises(ConfigError, match="section.key=value"):
        parity.parse_overrides(["outer.lr"])
    with pytest.raises(ConfigError, match="sync.merge"):
        parity.with_overrides(manifest, parity.parse_overrides(["sync.merge=median"]))


def test_benchmark_manifest_takes_the_re_swept_warm_up_and_period_for_every_mode():
    full = parity.benchmark_manifest(600, 0)
    assert (full.inner.warmup_steps, full.sync.period) == (200, 28)
    assert full.outer == parity.default_manifest(600, 0).outer  # outer settings unchanged by the re-sweep
    smoke = parity.benchmark_manifest(64, 0)
    assert (smoke.inner.warmup_steps, smoke.sync.period) == (21, parity.default_manifest(64, 0).sync.period)
