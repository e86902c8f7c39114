"""`[run.sync] preset` (config/presets.py): a named recipe fills in keys, explicit keys win."""

import pytest

from diloco_node.config.manifest import ConfigError, RunManifest
from diloco_node.config.presets import SYNC_PRESETS


def test_the_sparseloco_preset_sets_the_recipe_and_keeps_the_expanded_keys_not_the_name():
    m = RunManifest.from_dict({"sync": {"preset": "sparseloco"}})
    assert (m.sync.codec_up, m.sync.codec_down, m.sync.merge) == ("topk2", "union8", "support_mean")
    assert m.sync.uses_error_feedback and (m.sync.error_feedback_decay, m.sync.period) == (0.9, 20)
    assert (m.outer.lr, m.outer.momentum) == (1.5, 0.0)
    assert "preset" not in m.to_dict()["sync"]
    assert RunManifest.from_dict(m.to_dict()) == m  # what peers exchange rebuilds the same run


def test_a_key_the_config_sets_wins_over_the_preset():
    m = RunManifest.from_dict({"sync": {"preset": "sparseloco", "merge": "mean", "period": 28},
                               "outer": {"lr": 0.7}})
    assert (m.sync.merge, m.outer.lr, m.outer.momentum, m.sync.codec_up) == ("mean", 0.7, 0.0, "topk2")
    assert (m.sync.period, m.sync.error_feedback_decay) == (28, 0.9)


def test_an_unknown_preset_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match="sparseloco"):
        RunManifest.from_dict({"sync": {"preset": "sparsest"}})
    assert set(SYNC_PRESETS) == {"sparseloco"}


def test_the_parity_benchmark_takes_the_preset_as_an_override():
    import benchmarks.parity as parity
    m = parity.with_overrides(parity.benchmark_manifest(600, 0),
                              parity.parse_overrides(["sync.preset=sparseloco", "outer.lr=0.9"]))
    assert (m.sync.codec_up, m.outer.lr, m.outer.momentum) == ("topk2", 0.9, 0.0)
