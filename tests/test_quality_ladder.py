"""The quality ladder's arithmetic and refusals (benchmarks/quality_ladder.py); its runs are benchmarks."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import quality_ladder  # noqa: E402


def test_steps_give_at_least_the_stated_tokens_per_parameter():
    steps = quality_ladder.steps_for(6_361_344, 10, 128, 256)
    assert steps == 1942 and steps * 128 * 256 >= 10 * 6_361_344 > (steps - 1) * 128 * 256
    assert quality_ladder.steps_for(10, 0.001, 8, 64) == 1


def test_gaps_pair_each_presets_modes_and_skip_a_rung_that_lacks_one():
    rows = [{"preset": "a", "params": 5, "tokens": 50, "mode": "data_parallel", "eval_loss": 2.0, "bytes": 1000},
            {"preset": "a", "params": 5, "tokens": 50, "mode": "decoupled", "eval_loss": 2.1, "bytes": 4},
            {"preset": "b", "params": 9, "tokens": 90, "mode": "data_parallel", "eval_loss": 1.0, "bytes": 9}]
    assert quality_ladder.ladder_gaps(rows) == [{"preset": "a", "params": 5, "tokens": 50, "recipe": "int4",
                                                 "gap": 0.05, "bytes_ratio": 250.0}]
    sparse = {"preset": "a", "params": 5, "tokens": 50, "mode": "decoupled", "recipe": "sparseloco",
              "eval_loss": 2.2, "bytes": 1}
    assert [(g["recipe"], g["gap"], g["bytes_ratio"]) for g in quality_ladder.ladder_gaps(rows + [sparse])] == [
        ("int4", 0.05, 250.0), ("sparseloco", 0.1, 1000.0)]


def test_too_few_tokens_per_parameter_or_a_file_of_other_settings_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        quality_ladder.main(["--presets", "llama-1m", "--tokens-per-param", "2", "--json", str(tmp_path / "q.json")])
    assert "--smoke" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [], "settings": {"tokens_per_param": 20}}))
    with pytest.raises(SystemExit):
        quality_ladder.main(["--presets", "llama-1m", "--json", str(other)])
    assert "other settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality_ladder.main(["--presets", "nope", "--json", str(other)])
