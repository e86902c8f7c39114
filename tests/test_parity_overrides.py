"""The parity benchmark's manifest overrides (--set, --dp-set) and its re-swept defaults."""

import os
import sys

import pytest

from diloco_node.config.manifest import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import parity  # noqa: E402

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
