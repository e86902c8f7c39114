"""The run manifest: validation, unknown keys, digests and differences."""

import pytest

from diloco_node.config.manifest import ConfigError, RunManifest, SyncSpec


def test_default_manifest_round_trips_through_dict():
    manifest = RunManifest()
    again = RunManifest.from_dict(manifest.to_dict())
    assert again == manifest
    assert again.digest() == manifest.digest()


def test_unknown_section_and_key_are_named_in_the_error():
    with pytest.raises(ConfigError, match="unknown key\\(s\\) modle"):
        RunManifest.from_dict({"modle": {}})
    with pytest.raises(ConfigError, match="sync: unknown key\\(s\\) perod"):
        RunManifest.from_dict({"sync": {"perod": 10}})


def test_out_of_range_values_are_refused_with_the_field_name():
    with pytest.raises(ConfigError, match="sync.fragments = 40 > sync.period = 32"):
        SyncSpec(fragments=40, period=32)
    with pytest.raises(ConfigError, match="sync.codec_up = 'int3'"):
        RunManifest.from_dict({"sync": {"codec_up": "int3"}})
    with pytest.raises(ConfigError, match="outer.lr = 'fast': must be a number"):
        RunManifest.from_dict({"outer": {"lr": "fast"}})


def test_differences_list_each_disagreeing_key():
    a = RunManifest()
    b = RunManifest.from_dict({"sync": {"period": 16}, "outer": {"lr": 0.4}})
    assert a.digest() != b.digest()
    assert a.differences(b) == ["outer.lr: 0.7 != 0.4", "sync.period: 28 != 16"]
    assert a.differences(a) == []
