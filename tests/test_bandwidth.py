"""The bandwidth calculator: hand-computed arithmetic, the paper's factors, and the CLI."""

from __future__ import annotations

import json

import pytest

from diloco_node import cli
from diloco_node.sim import bandwidth
from diloco_node.sim.bandwidth import BandwidthInputs, compute

# Every number below is worked out by hand in the comments, not by the code under test.
HAND = BandwidthInputs(
    params=1e9, step_time_s=0.5, sites=4, fragments=10, period=20, tau=3,
    dp_bits=16, decoupled_bits=4, down_bits=16, target_utilisation=0.8, dp_overlap=0.5,
)


def test_paper_accounting_by_hand():
    r = compute(HAND)
    assert r.dp_paper_gbps == pytest.approx(32.0)  # 1e9 * 16 / 0.5 s
    assert r.decoupled_paper_gbps == pytest.approx(0.4 / 1.5)  # (1e8 * 4 bit) / (3 * 0.5 s)


def test_strict_accounting_by_hand():
    r = compute(HAND)
    # ring 2*3/4 = 1.5; stall budget 0.5*(1/0.8 - 1) = 0.125 s; window 0.25 + 0.125 = 0.375 s
    assert r.dp_strict_gbps == pytest.approx(1.5 * 16 / 0.375)  # = 64
    # up: deadline 4e8 bit / (1.5 + 2*0.125 s) = 0.2286; sustained 4e8 * 0.5 * 0.8 / 0.5 = 0.32
    assert r.decoupled_strict_up_gbps == pytest.approx(0.32)
    # down at 16 bit: 1.6e9 * 0.5 * 0.8 / 0.5 = 1.28 (sustained beats 1.6e9 / 1.75 = 0.914)
    assert r.decoupled_strict_down_gbps == pytest.approx(1.28)
    assert r.strict_ratio == pytest.approx(64 / 1.28)


def test_deadline_dominates_when_fragments_are_spaced_more_than_tau_apart():
    r = compute(BandwidthInputs(params=2.4e9, step_time_s=1.0, fragments=4, period=40, tau=2))
    # fragment 6e8 values * 4 bit = 2.4e9 bit; deadline over 2 s = 1.2; sustained 2.4e9/10 = 0.24
    assert r.decoupled_strict_up_gbps == pytest.approx(1.2)
    assert not any("in flight" in line for line in r.lines)


def test_paper_factors_multiply_to_192():
    r = compute(BandwidthInputs(params=7e9, step_time_s=0.8))  # P = H = 24, tau = 2, 16 vs 4 bit
    assert r.paper_ratio == pytest.approx(4 * 24 * 2)
    assert any("16/4 = 4x, fragment 1/P = 24x, tau = 2x -> 192x" in line for line in r.lines)


def test_paper_setting_reproduces_198_and_is_within_1_5x_of_0_84():
    r = compute(bandwidth.paper_setting())
    assert r.dp_paper_gbps == pytest.approx(198.0)
    assert 1 / 1.5 < r.decoupled_paper_gbps / bandwidth.PAPER_DECOUPLED_GBPS < 1.5
    assert r.decoupled_paper_gbps == pytest.approx(198.0 / 192)


def test_lines_show_the_numbers_they_claim():
    r = compute(HAND)
    text = "\n".join(r.lines)
    assert "2(S-1)/S = 1.5" in text
    assert "64 Gbit/s" in text
    assert "0.32 Gbit/s" in text
    # the deadline window includes H/P steps' worth of stall budget, and the line says so
    assert "may take tau x step + H/P x stall budget = 3 x 0.5 s + 2 x 0.125 s = 1.75 s" in text


@pytest.mark.parametrize(
    "change,message",
    [({"params": -1.0}, "params"), ({"step_time_s": 0.0}, "step_time_s"), ({"sites": 1}, "sites"),
     ({"fragments": 30}, "cannot exceed period"), ({"tau": 0}, "tau"),
     ({"target_utilisation": 0.0}, "target_utilisation"), ({"dp_overlap": 1.5}, "dp_overlap"),
     ({"dp_overlap": 0.0}, "infinite bandwidth")],
)
def test_bad_inputs_are_rejected_by_name(change, message):
    base = {"params": 1e9, "step_time_s": 1.0}
    with pytest.raises(ValueError, match=message):
        BandwidthInputs(**{**base, **change})


def test_cli_json_shape(capsys):
    assert cli.main(["bandwidth", "--params", "12B", "--step-time", "1", "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["inputs"]["params"] == 12e9
    assert set(report["paper"]) == {"data_parallel_gbps", "decoupled_gbps", "ratio"}
    assert set(report["strict"]) >= {"data_parallel_gbps", "decoupled_up_gbps", "decoupled_gbps"}
    assert report["paper"]["data_parallel_gbps"] == pytest.approx(192.0)
    assert "paper accounting" in captured.err


def test_cli_paper_mode_prints_the_comparison(capsys):
    assert cli.main(["bandwidth", "--paper"]) == 0
    out = capsys.readouterr().out
    assert "against the paper" in out
    assert "decoupled: ours 1.031 vs paper 0.84" in out


@pytest.mark.parametrize(
    "argv,message",
    [(["--params", "-3", "--step-time", "1"], "params must be a positive"),
     (["--params", "1e9"], "--params and --step-time are required"),
     (["--params", "1e9", "--step-time", "1", "--sites", "0"], "sites")],
)
def test_cli_bad_input_exits_2(capsys, argv, message):
    assert cli.main(["bandwidth", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_unparseable_number_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bandwidth", "--params", "lots", "--step-time", "1"])
    assert exc.value.code == 2
    assert "not a number" in capsys.readouterr().err


def test_cli_unwritable_json_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["bandwidth", "--paper", "--json", str(blocker / "out.json")]) == 1
    assert f"diloco-node bandwidth: error: cannot write {blocker / 'out.json'}" in capsys.readouterr().err
