"""Error feedback in the learner (learn/error_feedback.py): the remainder is what the codec
dropped, it goes out with the next send, it is reset when the weights stop following the sends,
and it survives a checkpoint. Int4 both ways (no error feedback) reproduces the runs made before."""

import dataclasses

import numpy as np
import pytest

from diloco_node.config.manifest import ConfigError, RunManifest, SyncSpec
from diloco_node.learn import data as data_lib
from diloco_node.learn.error_feedback import ErrorFeedback, codec_quantizer
from diloco_node.learn.learner_thread import LearnerSnapshot, snapshot_from_checkpoint, snapshot_meta_and_arrays
from diloco_node.sim import runner

from test_runner import _config


def top2_of_8(values):
    """A stand-in sparse codec: per 8 values the 2 largest by magnitude, exactly, the rest 0."""
    out = {}
    for name, x in values.items():
        flat = np.asarray(x, np.float32).reshape(-1, 8)
        keep = np.argsort(-np.abs(flat), axis=1, kind="stable")[:, :2]
        q = np.zeros_like(flat)
        np.put_along_axis(q, keep, np.take_along_axis(flat, keep, axis=1), axis=1)
        out[name] = q.reshape(np.shape(x))
    return out


def _delta(seed):
    return {"w": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)}


def test_the_remainder_is_what_the_codec_dropped_and_goes_out_with_the_next_send():
    ef = ErrorFeedback(1.0, top2_of_8)
    first = _delta(0)
    sent = ef.compensate(0, first)
    np.testing.assert_array_equal(sent["w"], first["w"])  # nothing owed yet
    q = top2_of_8(sent)["w"]
    np.testing.assert_array_equal(ef.remainder(0)["w"], first["w"] - q)
    assert np.count_nonzero(ef.remainder(0)["w"]) == 4 * 6  # 6 of every 8 values were dropped
    second = _delta(1)
    np.testing.assert_array_equal(ef.compensate(0, second)["w"], (first["w"] - q) + second["w"])
    assert ef.remainder(1) == {}  # another fragment owes nothing


def test_with_decay_one_what_was_sent_plus_the_remainder_is_every_delta():
    ef = ErrorFeedback(1.0, top2_of_8)
    deltas = [_delta(seed) for seed in range(6)]
    received = sum(top2_of_8(ef.compensate(0, d))["w"] for d in deltas)
    np.testing.assert_allclose(received + ef.remainder(0)["w"], sum(d["w"] for d in deltas), rtol=1e-5, atol=1e-5)


def test_the_decay_scales_the_remainder_before_the_next_delta_is_added():
    ef = ErrorFeedback(0.5, top2_of_8)
    ef.compensate(0, _delta(0))
    owed = ef.remainder(0)["w"]
    np.testing.assert_array_equal(ef.compensate(0, _delta(1))["w"], np.float32(0.5) * owed + _delta(1)["w"])
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(1.5, top2_of_8)


def test_reset_forgets_one_fragment_or_all():
    ef = ErrorFeedback(1.0, top2_of_8)
    ef.compensate(0, _delta(0))
    ef.compensate(1, {"v": _delta(1)["w"]})
    assert ef.nbytes() == 2 * 32 * 4  # float32: 4 bytes per parameter
    ef.reset(0)
    assert ef.remainder(0) == {} and "v" in ef.remainder(1)
    ef.reset()
    assert ef.state() == {} and ef.nbytes() == 0
    np.testing.assert_array_equal(ef.compensate(1, {"v": _delta(2)["w"]})["v"], _delta(2)["w"])


def test_the_remainders_round_trip_through_the_learner_checkpoint():
    ef = ErrorFeedback(1.0, top2_of_8)
    ef.compensate(0, _delta(0))
    ef.compensate(1, {"v": _delta(1)["w"]})
    snap = LearnerSnapshot(7, 70, {"w": np.zeros((4, 8), np.float32)}, [np.zeros(3, np.float32)], [1, 2], [3, 4],
                           [30, 40], "", ef.state())
    meta, arrays = snapshot_meta_and_arrays(snap)
    back = snapshot_from_checkpoint(meta, arrays)
    assert set(back.error_feedback) == {"w", "v"}
    restored = ErrorFeedback(1.0, top2_of_8)
    restored.load(back.error_feedback, {0: ("w",), 1: ("v",)})
    for p in (0, 1):
        for name, value in ef.remainder(p).items():
            np.testing.assert_array_equal(restored.remainder(p)[name], value)
    with pytest.raises(ValueError, match="unknown parameters: v"):
        restored.load(back.error_feedback, {0: ("w",)})
    # A checkpoint written before error feedback existed has none.
    old_meta, old_arrays = snapshot_meta_and_arrays(LearnerSnapshot(1, 1, {}, [], [0], [0], [0]))
    assert snapshot_from_checkpoint(old_meta, old_arrays).error_feedback == {}


def test_the_error_feedback_keys_are_checked_and_only_a_sparse_codec_uses_them():
    assert not SyncSpec(codec_up="int4", error_feedback=True).uses_error_feedback
    with pytest.raises(ConfigError, match="sync.error_feedback_decay"):
        SyncSpec(error_feedback_decay=1.5)
    with pytest.raises(ConfigError, match="sync.error_feedback = 'yes'"):
        RunManifest.from_dict({"sync": {"error_feedback": "yes"}})


@pytest.fixture(scope="module")
def corpus():
    full = data_lib.stdlib_corpus()
    return data_lib.Corpus(full.train[:400_000], full.eval[:50_000], 256, "stdlib slice")


def test_int4_both_ways_with_error_feedback_on_is_the_very_run_with_it_off(corpus):
    # int4 keeps no remainder, so the key must change nothing: the same bytes, merges, merge log
    # and eval loss, bit for bit, in one process (same compiled programs). The outage scenario
    # makes a learner miss rounds, where a remainder, if one were kept, would be carried.
    config = _config("decoupled", "outage")
    runs = {}
    for error_feedback in (False, True):
        sync = dataclasses.replace(config.manifest.sync, error_feedback=error_feedback)
        assert (sync.codec_up, sync.codec_down) == ("int4", "int4") and not sync.uses_error_feedback
        result = runner.run(dataclasses.replace(config, manifest=dataclasses.replace(config.manifest, sync=sync)),
                            corpus)
        runs[error_feedback] = (result.bytes_up, result.bytes_down, result.merges, result.merge_log,
                                result.eval_loss)
    assert runs[True] == runs[False]
    assert runs[True][2] == 8  # the outage run merges (checked against the run before error feedback existed)


# ------------------------------------------------------------------ with the real sparse codec

SPARSE = RunManifest(model=_config("decoupled").manifest.model,
                     inner=_config("decoupled").manifest.inner,
                     sync=SyncSpec(fragments=2, period=8, overlap=2, codec_up="topk2", codec_down="union8"))


def _learner_thread():
    from diloco_node.learn import model as model_lib
    from diloco_node.learn import factory
    from diloco_node.learn.learner_thread import LearnerThread
    from diloco_node.sync.fragments import plan_fragments

    _, params = factory.init_params(factory.recipe(SPARSE.model), 0)
    initial = model_lib.flat_params(params)
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 8, 2)
    corpus = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8),
                             np.arange(512, dtype=np.uint8), 256, "random bytes")
    sent = []
    thread = LearnerThread(node_id="a", manifest=SPARSE, plan=plan, corpus=corpus, global_params=initial,
                           global_rounds=[0, 0], on_contribution=sent.append, on_progress=lambda *a: None)
    return thread, plan, initial, sent


def _biggest_fragment(plan, initial):
    return max(range(plan.num_fragments), key=lambda p: sum(initial[n].size for n in plan.fragments[p].names))


def test_the_learner_thread_sends_x_keeps_x_minus_q_and_keeps_it_through_a_checkpoint():
    from wire.codecs import decode_named, encode_named

    thread, plan, initial, _ = _learner_thread()
    p = _biggest_fragment(plan, initial)
    names = plan.fragments[p].names
    rng = np.random.default_rng(1)
    delta = {n: (1e-3 * rng.standard_normal(initial[n].shape)).astype(np.float32) for n in names}
    due = thread._contribution(p, 0, 8, 8 * 32, dict(delta), 8)
    received = decode_named(encode_named(due.delta, "topk2"))  # what the syncer decodes
    remainder = thread._error_feedback.remainder(p)
    for n in names:
        np.testing.assert_array_equal(remainder[n], due.delta[n] - received[n])
    assert sum(np.count_nonzero(remainder[n]) for n in names) > 0.9 * sum(delta[n].size for n in names)
    # the next send carries the remainder, decayed by beta (the manifest's)
    second = thread._contribution(p, 0, 8, 8 * 32, dict(delta), 16)
    beta = np.float32(SPARSE.sync.error_feedback_decay)
    assert beta == np.float32(0.95)
    for n in names:
        np.testing.assert_array_equal(second.delta[n], np.add(beta * remainder[n], delta[n], dtype=np.float32))
    # a restarted learner keeps it: the state copy, the checkpoint's arrays, a new thread's restore
    future = thread.request_state()
    thread._answer_state_requests()
    meta, arrays = snapshot_meta_and_arrays(future.result(5))
    restarted, *_ = _learner_thread()
    restarted.restore(snapshot_from_checkpoint(meta, arrays))
    for n in names:
        np.testing.assert_array_equal(restarted._error_feedback.remainder(p)[n], thread._error_feedback.remainder(p)[n])


def test_the_remainder_is_reset_when_a_state_is_installed_not_when_a_merge_is_applied():
    thread, plan, initial, _ = _learner_thread()
    rng = np.random.default_rng(2)
    for p in range(plan.num_fragments):
        thread._contribution(p, 0, 8, 256, {n: (1e-3 * rng.standard_normal(initial[n].shape)).astype(np.float32)
                                            for n in plan.fragments[p].names}, 8)
    fragment = lambda p: {n: initial[n] + np.float32(0.01) for n in plan.fragments[p].names}  # noqa: E731
    thread.offer_fragment(0, 1, fragment(0), contributors=("a", "b"))  # a merge: the sends go on
    thread.offer_fragment(1, 1, fragment(1))  # downloaded or repaired: installed
    thread.take_offers()
    assert thread._error_feedback.remainder(0) and thread._error_feedback.remainder(1) == {}
    thread.adopt_global(initial, [1, 1])  # a fresh state adopted: nothing is owed
    assert thread._error_feedback.state() == {}


def _sparse_run(corpus, scenario="uniform", topk2=None, **sync):
    config = _config("decoupled", scenario)
    spec = dataclasses.replace(config.manifest.sync, codec_up="topk2", codec_down="union8", **sync)
    return runner.run(dataclasses.replace(config, manifest=dataclasses.replace(config.manifest, sync=spec),
                                          topk2=topk2), corpus)


def test_the_runner_sends_the_remainder_with_error_feedback_on_and_its_decay_matters(corpus):
    on, off, decayed = _sparse_run(corpus), _sparse_run(corpus, error_feedback=False), \
        _sparse_run(corpus, error_feedback_decay=0.5)
    assert len({on.eval_loss, off.eval_loss, decayed.eval_loss}) == 3
    # sparse up, sparse union down: far fewer bytes than int4 both ways for the same run
    int4 = runner.run(_config("decoupled"), corpus)
    assert on.bytes_up * 5 < int4.bytes_up and on.bytes_cross_site * 2 < int4.bytes_cross_site
    # per-round diagnostics of the sparse uplink: one row per merge, none for a dense codec
    assert len(on.sparse_rounds) == on.merges and int4.sparse_rounds == []
    assert all(r["remainder_over_delta"] > 0 for r in on.sparse_rounds if r["remainder_over_delta"] is not None)
    assert all(r["remainder_over_delta"] in (0.0, None) for r in off.sparse_rounds)
    coverage = [r["sent_ever"] for r in on.sparse_rounds if r["fragment"] == 0]
    assert coverage == sorted(coverage) and 0 < coverage[-1] < 1
    # a measurement's own k and C (RunnerConfig.topk2): fewer values sent, in every round
    fewer = _sparse_run(corpus, topk2=(16, 2048))
    assert fewer.bytes_up < on.bytes_up and fewer.eval_loss != on.eval_loss
    assert fewer.sparse_rounds[0]["sent_ever"] < on.sparse_rounds[0]["sent_ever"]


def test_the_quantizer_and_the_runner_take_topk2s_k_and_chunk_and_check_them():
    x = {"w": np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)}
    for k, chunk, kept in ((8, 1024, 16), (8, 512, 32), (None, None, 0)):  # 2,048 values: < C 4,096 goes int4
        q = codec_quantizer("topk2", top_k=k, block_size=chunk)(x)["w"]
        assert q.shape == (2, 1024) and (np.count_nonzero(q) == kept if kept else np.count_nonzero(q) > 1000)
    sparse = dataclasses.replace(_config("decoupled").manifest.sync, codec_up="topk2", codec_down="union8")
    manifest = dataclasses.replace(_config("decoupled").manifest, sync=sparse)
    with pytest.raises(ValueError, match="uplink codec is int4, not topk2"):
        _config("decoupled", topk2=(32, 4096))
    for bad in ((0, 4096), (64, 32), (64, 4000)):
        with pytest.raises(ValueError, match="topk2 = "):
            runner.RunnerConfig(manifest, topk2=bad)
    assert runner.RunnerConfig(manifest, topk2=(32, 1024)).uplink_codec_args == {"top_k": 32, "block_size": 1024}
    assert runner.RunnerConfig(manifest).uplink_codec_args == {}
