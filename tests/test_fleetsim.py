"""The fleet goodput simulator: determinism, limits, analytic checks, and the `simulate` CLI."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from dataclasses import replace

import pytest

from diloco_node import cli
from diloco_node.sim import fleetsim
from diloco_node.sim.fleetsim import FleetParams, JobResult, quorum_uptime, simulate_fleet, simulate_job

# Small horizons keep every test well under a second.
QUICK = FleetParams(expected_failures=2_000)
NO_FAILURES = replace(QUICK, mtbi_chip_s=1e30, wall_time_s=1e6)


def _job(seed: int, *, elastic: bool = True, params: FleetParams = QUICK, record: bool = True):
    return simulate_job(
        200,
        elastic=elastic,
        params=params,
        horizon_s=params.horizon_s(200 * params.slice_chips),
        rng=fleetsim.learner_rng(seed, 0),
        record_events=record,
    )


def test_same_seed_gives_identical_schedule_and_results():
    a, b = _job(7), _job(7)
    assert a.events == b.events
    assert a.productive_chip_s == b.productive_chip_s
    assert a.up_intervals == b.up_intervals


def test_different_seeds_give_different_schedules():
    assert _job(1).events != _job(2).events


def test_events_are_time_ordered_and_intervals_disjoint():
    job = _job(3)
    times = [t for t, _, _ in job.events]
    assert len(times) > 100
    assert times == sorted(times)
    assert all(0 <= healthy <= 200 for _, _, healthy in job.events)
    previous_end = 0.0
    for start, end in job.up_intervals:
        assert previous_end <= start < end <= job.horizon_s
        previous_end = end


def test_changes_while_training_pause_the_job_and_changes_while_paused_are_absorbed():
    job = _job(4)
    kinds = [kind for _, kind, _ in job.events]
    paused = False
    absorbed = 0
    for i, kind in enumerate(kinds):
        if kind == "pause":
            assert not paused, "a pause started while already paused"
            assert kinds[i - 1] in ("failure", "repair")
            paused = True
        elif kind == "resume":
            assert paused
            paused = False
        elif kind in ("failure", "repair"):
            following = kinds[i + 1] if i + 1 < len(kinds) else None
            if paused:
                absorbed += 1
                assert following != "pause"
            else:
                assert following == "pause"
    assert kinds.count("pause") == job.pauses + sum(1 for t, k, _ in job.events if k == "pause" and t < 0)
    assert absorbed > 0  # at 200 slices some changes land inside a pause


@pytest.mark.parametrize("strategy,m", [("dp", 1), ("elastic_dp", 1), ("decoupled", 4)])
@pytest.mark.parametrize("chips", [20_000, 1_200_000])
def test_goodput_and_uptime_are_fractions(strategy, m, chips):
    r = simulate_fleet(strategy, chips, QUICK, learners=m)
    assert 0.0 <= r.goodput <= 1.0
    assert 0.0 <= r.uptime <= 1.0
    assert r.goodput <= r.uptime + 1e-12  # no productive work while the model stands still (K=1)


@pytest.mark.parametrize("strategy,m", [("dp", 1), ("elastic_dp", 1), ("decoupled", 8)])
def test_no_failures_means_full_goodput(strategy, m):
    r = simulate_fleet(strategy, 1_200_000, NO_FAILURES, learners=m)
    assert r.goodput == pytest.approx(1.0, abs=1e-12)
    assert r.uptime == pytest.approx(1.0, abs=1e-12)
    assert r.failures == 0


def test_one_decoupled_learner_replays_elastic_dp_exactly():
    params = replace(QUICK, speed_spread=0.2, slowdown_rate_per_slice=1e-4)
    elastic = simulate_fleet("elastic_dp", 600_000, params, seed=11)
    single = simulate_fleet("decoupled", 600_000, params, learners=1, quorum=1, seed=11)
    assert single.goodput == elastic.goodput
    assert single.uptime == elastic.uptime
    assert single.pauses == elastic.pauses


def test_full_quorum_uptime_never_exceeds_any_quorum():
    uptimes = [
        simulate_fleet("decoupled", 2_400_000, QUICK, learners=4, quorum=k).uptime for k in (1, 2, 3, 4)
    ]
    assert uptimes == sorted(uptimes, reverse=True)
    assert uptimes[-1] < uptimes[0]


def test_quorum_uptime_on_hand_made_intervals():
    def job(intervals):
        return JobResult(chips=1, horizon_s=10, productive_chip_s=0, up_intervals=intervals,
                         failures=0, pauses=0)

    jobs = [job([(0, 4), (6, 10)]), job([(2, 8)])]
    assert quorum_uptime(jobs, 1, 10) == pytest.approx(1.0)
    assert quorum_uptime(jobs, 2, 10) == pytest.approx(0.4)  # [2,4) and [6,8)
    with pytest.raises(ValueError, match="quorum"):
        quorum_uptime(jobs, 3, 10)


def test_dp_matches_the_renewal_formula():
    """Training spans average MTBI/N, each ends in one restart that absorbs further failures."""
    params = replace(QUICK, expected_failures=8_000)
    chips = 1_200_000
    r = simulate_fleet("dp", chips, params)
    rate = r.chips / params.mtbi_chip_s
    assert r.goodput == pytest.approx(1 / (1 + rate * params.restart_s), abs=0.015)


def test_elastic_without_pauses_loses_the_share_of_slices_under_repair():
    params = replace(QUICK, downscale_s=0.0, upscale_s=0.0, repair_s=20 * 3600.0)
    r = simulate_fleet("elastic_dp", 300_000, params)
    slice_rate = params.slice_chips / params.mtbi_chip_s
    healthy_share = 1 / (1 + slice_rate * params.repair_s)
    assert r.goodput == pytest.approx(healthy_share, abs=0.01)
    assert r.uptime == pytest.approx(1.0)


def test_decoupled_gets_the_goodput_of_elastic_at_n_over_m():
    decoupled = simulate_fleet("decoupled", 1_200_000, QUICK, learners=8)
    elastic_small = simulate_fleet("elastic_dp", 150_000, QUICK)
    assert decoupled.goodput == pytest.approx(elastic_small.goodput, abs=0.015)
    assert "8 learners" in decoupled.reason


def test_static_heterogeneity_gates_synchronous_jobs_at_the_slowest_speed():
    params = replace(NO_FAILURES, speed_spread=0.4)
    assert simulate_fleet("dp", 100_000, params).goodput == pytest.approx(0.6)
    # learners at 1.0, 0.8, 0.6: each runs at its own speed
    assert simulate_fleet("decoupled", 100_000, params, learners=3).goodput == pytest.approx(0.8, abs=0.01)


def test_transient_slowdowns_cost_what_their_stationary_share_predicts():
    params = replace(NO_FAILURES, slowdown_rate_per_slice=1e-4, slowdown_mean_s=100.0,
                     slowdown_factor=0.5, wall_time_s=2e7)
    n_slices = 20
    chips = n_slices * params.slice_chips
    r = simulate_fleet("dp", chips, params)
    q = 1e-4 / (1e-4 + 1 / 100.0)
    p_any_slow = 1 - (1 - q) ** n_slices
    assert r.goodput == pytest.approx(1 - 0.5 * p_any_slow, abs=0.01)


def test_default_sweep_is_near_the_paper_at_1_2m_chips():
    """A reduced-horizon check of the calibrated defaults (the benchmark runs the full sweep)."""
    params = FleetParams(expected_failures=4_000)
    got = {
        "dp": simulate_fleet("dp", 1_200_000, params).goodput,
        "elastic_dp": simulate_fleet("elastic_dp", 1_200_000, params).goodput,
        "M=8": simulate_fleet("decoupled", 1_200_000, params, learners=8).goodput,
    }
    assert got["dp"] == pytest.approx(0.27, abs=0.05)
    assert got["elastic_dp"] == pytest.approx(0.58, abs=0.05)
    assert got["M=8"] == pytest.approx(0.88, abs=0.05)


@pytest.mark.parametrize(
    "field,value",
    [("mtbi_chip_s", -1.0), ("slice_chips", 0), ("repair_s", math.nan), ("downscale_s", -2.0),
     ("speed_spread", 1.0), ("slowdown_factor", 0.0), ("expected_failures", 0)],
)
def test_bad_parameters_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        FleetParams(**{field: value})


def test_bad_fleet_arguments_are_rejected():
    with pytest.raises(ValueError, match="chips"):
        simulate_fleet("dp", -5, QUICK)
    with pytest.raises(ValueError, match="quorum"):
        simulate_fleet("decoupled", 100_000, QUICK, learners=2, quorum=3)
    with pytest.raises(ValueError, match="unknown strategy"):
        simulate_fleet("pipeline", 100_000, QUICK)
    with pytest.raises(ValueError, match="exceed the limit"):
        simulate_fleet("dp", 100_000, replace(QUICK, expected_failures=10**9))
    with pytest.raises(ValueError, match="learners \\(M\\) must be a positive integer, got 0"):
        simulate_fleet("decoupled", 100_000, QUICK, learners=0)
    with pytest.raises(ValueError, match="wall_time_s must be a positive finite number"):
        replace(QUICK, wall_time_s=math.inf)
    with pytest.raises(ValueError, match="unknown strategy 'pipeline'"):
        fleetsim.run_sweep(QUICK, strategies=["dp", "pipeline"])
    with pytest.raises(ValueError, match="at least one slice"):
        simulate_job(0, elastic=True, params=QUICK, horizon_s=1.0, rng=fleetsim.learner_rng(0, 0))


@pytest.mark.parametrize(
    "change",
    [{"slowdown_rate_per_slice": 1.0},  # a typo for 1e-4: ~150 slowdown events per second of fleet time
     {"repair_s": 1e9}],  # the warm-up (3 repair times) alone would hold ~1e8 failures and repairs
    ids=["slowdown events", "warm-up events"],
)
def test_runs_whose_events_exceed_the_limit_fail_fast(change):
    # the failure count of the measured horizon is small here; the events come from elsewhere
    with pytest.raises(ValueError, match="expected events .* exceed the limit"):
        simulate_fleet("elastic_dp", 1_200_000, replace(QUICK, **change))


SMALL_RUN = ["simulate", "--chips", "50000", "200000", "--learners", "2", "4",
             "--expected-failures", "500", "--plot", "none"]


def test_cli_writes_json_with_one_result_per_configuration(capsys):
    assert cli.main([*SMALL_RUN, "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert set(report) >= {"params", "seed", "wall_time_s", "results"}
    assert report["params"]["slice_chips"] == fleetsim.DEFAULT_SLICE_CHIPS
    results = report["results"]
    assert len(results) == 2 * (1 + 1 + 2)  # sizes x (dp, elastic, M=2, M=4)
    for r in results:
        assert set(r) >= {"strategy", "fleet_size", "chips", "learners", "quorum", "goodput",
                          "uptime", "reason"}
        assert 0 <= r["goodput"] <= 1
    assert "goodput % (uptime %)" in captured.err  # the table goes to stderr when JSON is on stdout


@pytest.mark.parametrize(
    "extra,message",
    [(["--chips", "-10"], "--chips must be positive"),
     (["--repair-s", "-1"], "repair_s"),
     (["--mtbi-years", "0"], "--mtbi-years"),
     (["--learners", "0"], "--learners")],
)
def test_cli_bad_input_exits_2_with_a_clear_message(capsys, extra, message):
    assert cli.main([*SMALL_RUN, "--json", "-", *extra]) == 2
    assert message in capsys.readouterr().err


def _plot_args(tmp_path):
    return ["simulate", "--chips", "50000", "--learners", "2", "--expected-failures", "300",
            "--json", str(tmp_path / "g.json"), "--plot", str(tmp_path / "g.png")]


def test_cli_writes_a_png_plot(tmp_path):
    pytest.importorskip("matplotlib")  # the optional `plot` extra
    assert cli.main(_plot_args(tmp_path)) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_matplotlib_still_writes_json_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it now raises ImportError
    assert cli.main(_plot_args(tmp_path)) == 0
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "g.png").exists()
    assert json.loads((tmp_path / "g.json").read_text())["results"]


def test_paper_goodput_points_are_where_the_paper_reports_them():
    def at(strategy, chips, m=1):
        return fleetsim.paper_goodput(simulate_fleet(strategy, chips, replace(QUICK, expected_failures=50), learners=m))

    assert [at("elastic_dp", n) for n in fleetsim.DEFAULT_FLEET_SIZES] == [88.0, 82.0, 70.0, 58.0, 40.0]
    assert (at("dp", 1_200_000), at("decoupled", 1_200_000, 8), at("decoupled", 1_200_000, 16)) == (27.0, 88.0, 93.0)
    assert at("dp", 600_000) is None and at("decoupled", 1_200_000, 3) is None


@pytest.mark.parametrize("target", ["--json", "--plot"])
def test_cli_unwritable_output_is_a_clear_error_not_a_traceback(tmp_path, capsys, target):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["simulate", "--chips", "20000", "--learners", "2", "--expected-failures", "100",
            "--json", str(tmp_path / "g.json"), "--plot", "none"]
    args[args.index(target) + 1] = str(blocker / "out")  # a path below a regular file
    assert cli.main(args) == 1
    assert f"diloco-node simulate: error: cannot write {blocker / 'out'}" in capsys.readouterr().err


def test_cli_writes_into_a_fresh_runs_directory_not_the_current_one(tmp_path, monkeypatch, capsys):
    """Without --out, --json or --plot, results go to runs/simulate-<UTC time>/, never loose into
    the current directory (issue 28 item 10)."""
    monkeypatch.chdir(tmp_path)
    args = ["simulate", "--chips", "20000", "--learners", "2", "--expected-failures", "100"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot's path, without drawing it
    assert cli.main(args) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("simulate-") and [p.name for p in run_dir.iterdir()] == ["fleetsim-goodput.json"]
    assert json.loads((run_dir / "fleetsim-goodput.json").read_text())["results"]
    assert f"wrote {Path('runs') / run_dir.name / 'fleetsim-goodput.json'}" in capsys.readouterr().out


def test_cli_out_names_the_directory_and_explicit_paths_still_win(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    base = ["simulate", "--chips", "20000", "--learners", "2", "--expected-failures", "100"]
    assert cli.main([*base, "--out", "sim/a"]) == 0
    assert sorted(p.name for p in (tmp_path / "sim" / "a").iterdir()) == ["fleetsim-goodput.json", "fleetsim-goodput.png"]
    assert cli.main([*base, "--out", "sim/b", "--json", "mine.json", "--plot", "none"]) == 0
    assert (tmp_path / "mine.json").is_file() and not (tmp_path / "sim" / "b").exists()
