"""`diloco-node train`: bad input is refused with exit 2, a short run trains and reports JSON."""

import json

from diloco_node import cli


def test_bad_speeds_are_refused_with_exit_2_and_the_value_named(capsys):
    assert cli.main(["train", "--steps", "40", "--speeds", "fast,slow"]) == 2
    assert "--speeds 'fast,slow'" in capsys.readouterr().err


def test_a_missing_data_path_is_named(tmp_path, capsys):
    missing = tmp_path / "nowhere.txt"
    assert cli.main(["train", "--steps", "40", "--data", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_a_short_decoupled_run_learns_merges_and_writes_json(tmp_path):
    out = tmp_path / "result.json"
    rc = cli.main(["train", "--steps", "48", "--batch-size", "4", "--seq-len", "32", "--period", "16",
                   "--fragments", "4", "--log-every", "0", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "decoupled"
    result = report["result"]
    assert result["merges"] > 0
    assert result["eval_loss"] < result["eval_loss_start"] - 0.5  # from ~ln(256) = 5.5 nats/byte
    assert report["manifest"]["sync"]["period"] == 16
