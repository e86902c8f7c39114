"""Configuration keys whose effect no other test observed: each test sets the key to two values
and checks that what the key configures behaves differently (issue 12: every documented key has
an effect a test observes; the key -> test table is tests/test_every_key_observed.py).

Where the daemon hands a key to a component, the test builds the component from a `NodeConfig`
and the daemon's plan (daemon/plan.py `plan_from`) the same way and drives it through its public
interface.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from bootstrap.coordinator_node import CoordinatorNode, NodeOptions, PersistentState
from bootstrap.election import LeaseTiming
from bootstrap.messages import AppendEntries, Send
from diloco_node.config.manifest import InnerOptimizer
from diloco_node.config.settings import NodeConfig, load_config
from diloco_node.daemon.persistence import compaction_point
from diloco_node.daemon.plan import plan_from
from diloco_node.learn.inner import make_optimizer
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.ops.logs import configure_logging
from diloco_node.sync.fragments import plan_fragments, wire_fit_problems

from conftest import free_port, node_config

SECRET_A = b"a" * 40
SECRET_B = b"b" * 40


# ------------------------------------------------------------------ [node] keys


def test_secret_credential_names_the_systemd_credential_the_secret_is_read_from(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    for name, secret in (("diloco-secret", SECRET_A), ("other-run", SECRET_B)):
        (credentials / name).write_bytes(secret + b"\n")
        (credentials / name).chmod(0o600)
    environ = {"CREDENTIALS_DIRECTORY": str(credentials), "DILOCO_DATA_DIR": str(tmp_path / "data")}
    default = load_config(None, environ)
    chosen = load_config(None, {**environ, "DILOCO_SECRET_CREDENTIAL": "other-run"})
    assert default.read_secret() == SECRET_A
    assert chosen.read_secret() == SECRET_B
    assert chosen.node.secret_file == credentials / "other-run"
    missing = load_config(None, {**environ, "DILOCO_SECRET_CREDENTIAL": "absent"})
    assert missing.node.secret_file is None
    assert any("no credential named 'absent'" in w for w in missing.warnings)


@pytest.mark.parametrize("level, shown", [("debug", {"DBG", "INF", "WRN"}), ("info", {"INF", "WRN"}),
                                          ("warning", {"WRN"}), ("error", set())])
def test_log_level_decides_which_records_are_written(tmp_path: Path, level: str, shown: set[str],
                                                     restore_root_logger: None) -> None:
    cfg = load_config(None, {"DILOCO_LOG_LEVEL": level, "DILOCO_DATA_DIR": str(tmp_path)}).node
    stream = io.StringIO()
    configure_logging(cfg.log_level, cfg.node_id, "text", environ={}, stream=stream)  # as cli/run.py does
    logger = logging.getLogger("diloco_node.test_key_effects")
    logger.debug("DBG")
    logger.info("INF")
    logger.warning("WRN")
    written = {word for word in ("DBG", "INF", "WRN") if word in stream.getvalue()}
    assert written == shown


def test_checkpoint_keep_is_how_many_checkpoints_stay_on_disk(tmp_path: Path) -> None:
    kept = {}
    for keep in (2, 4):
        cfg = node_config(checkpoint_keep=keep, data_dir=tmp_path / str(keep))
        # daemon/node.py: CheckpointStore(data_dir / "checkpoints", cfg.checkpoint_keep)
        with CheckpointStore(Path(cfg.data_dir) / "checkpoints", cfg.checkpoint_keep) as store:
            for step in range(6):
                store.save({"step": step}, {"w": np.full(3, step, np.float32)})
            kept[keep] = store.sequences()
    assert kept == {2: [5, 6], 4: [3, 4, 5, 6]}


def test_log_retain_entries_is_the_tail_kept_below_the_checkpoint() -> None:
    cuts = {}
    for retain in (0, 100, 256):
        cfg = node_config(log_retain_entries=retain)
        # daemon/persistence.py Checkpointer(retain_entries=cfg.log_retain_entries) -> compaction_point
        cuts[retain], _ = compaction_point(checkpoint_index=1000, commit_index=1200, snapshot_index=0,
                                           retain=cfg.log_retain_entries)
    assert cuts == {0: 1000, 100: 900, 256: 744}


def _coordination_pair(cfg: NodeConfig) -> dict[str, CoordinatorNode]:
    # daemon/parts.py SiteParts: the lease timing comes from these two keys, through the plan.
    plan = plan_from(cfg)
    lease = LeaseTiming(lease_s=plan.lease_s, heartbeat_interval_s=plan.heartbeat_interval_s)
    options = NodeOptions(lease=lease, leave_timeout_s=plan.leave_timeout_s, manage_membership=False)
    return {name: CoordinatorNode(name, PersistentState.founding(["a", "b"]), now=0.0, rng=random.Random(seed),
                                  options=options) for seed, name in enumerate("ab")}


def _run(nodes: dict[str, CoordinatorNode], start: float, until: float, deliver: bool = True) -> tuple[float, list[Send]]:
    """A zero-latency network and 10 ms ticks (simulated time); returns the sends seen."""
    now, pending, seen = start, [], []
    while now < until:
        while deliver and pending:
            send = pending.pop(0)
            pending += [a for a in nodes[send.to].handle(send.message, now) if isinstance(a, Send)]
        for member in nodes.values():
            sends = [a for a in member.tick(now) if isinstance(a, Send)]
            seen += [(now, member.node_id, s) for s in sends]
            pending += sends
        if not deliver:
            pending.clear()
        now = round(now + 0.01, 6)
    return now, seen


def _leader(nodes: dict[str, CoordinatorNode], now: float) -> CoordinatorNode:
    holders = [n for n in nodes.values() if n.is_lease_holder(now)]
    assert len(holders) == 1, "expected one lease holder"
    return holders[0]


def test_heartbeat_interval_s_is_how_often_the_lease_holder_sends_appends() -> None:
    counts = {}
    for heartbeat in (0.25, 0.5):
        nodes = _coordination_pair(node_config(heartbeat_interval_s=heartbeat, lease_timeout_s=3.0))
        now, _ = _run(nodes, 0.0, 20.0)
        leader = _leader(nodes, now)
        now, seen = _run(nodes, now, now + 10.0)
        counts[heartbeat] = sum(1 for _, sender, send in seen
                                if sender == leader.node_id and isinstance(send.message, AppendEntries))
    # Ten seconds of heartbeats: ~40 at 0.25 s, ~20 at 0.5 s (ticks are 10 ms, so +-1 each).
    assert 38 <= counts[0.25] <= 42 and 18 <= counts[0.5] <= 22


def test_lease_timeout_s_is_how_long_a_cut_off_holder_keeps_its_lease() -> None:
    held_after_4s = {}
    for lease_s in (3.0, 6.0):
        nodes = _coordination_pair(node_config(lease_timeout_s=lease_s, heartbeat_interval_s=0.5))
        now, _ = _run(nodes, 0.0, 30.0)
        leader = _leader(nodes, now)
        now, _ = _run(nodes, now, now + 4.0, deliver=False)  # the network drops everything from here
        held_after_4s[lease_s] = leader.is_lease_holder(now)
    assert held_after_4s == {3.0: False, 6.0: True}


# ------------------------------------------------------------------ [run.inner] optimizer keys


def _two_steps(inner: InnerOptimizer) -> dict[str, np.ndarray]:
    """Parameters after two AdamW steps with gradients of different sizes and directions."""
    import jax.numpy as jnp

    tx = make_optimizer(inner)
    params = {"w": jnp.full((2, 2), 1.0), "b": jnp.full((2,), 1.0)}
    state = tx.init(params)
    grads = [{"w": jnp.array([[30.0, -10.0], [5.0, 0.0]]), "b": jnp.array([20.0, 0.0])},
             {"w": jnp.array([[0.1, 0.2], [-0.3, 0.05]]), "b": jnp.array([-0.1, 0.3])}]
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = {k: params[k] + updates[k] for k in params}
    return {k: np.asarray(v) for k, v in params.items()}


BASE = InnerOptimizer(warmup_steps=1, total_steps=100, lr_peak=0.01)


@pytest.mark.parametrize("key, other", [("weight_decay", 0.0), ("b1", 0.5), ("b2", 0.5), ("grad_clip_norm", 100.0)])
def test_inner_optimizer_keys_change_the_update(key: str, other: float) -> None:
    base = _two_steps(BASE)
    changed = _two_steps(dataclasses.replace(BASE, **{key: other}))
    assert not np.allclose(base["w"], changed["w"], rtol=0, atol=1e-7), f"run.inner.{key} changed nothing"


def test_weight_decay_applies_to_matrices_only() -> None:
    base = _two_steps(BASE)
    no_decay = _two_steps(dataclasses.replace(BASE, weight_decay=0.0))
    np.testing.assert_array_equal(base["b"], no_decay["b"])  # a vector (bias, norm) is never decayed
    # The second step's decoupled decay pulls every weight towards 0 by lr * wd * w.
    assert np.all(np.abs(base["w"]) < np.abs(no_decay["w"]))


# ------------------------------------------------------------------ [run.sync] codecs


async def test_codec_up_is_the_codec_a_learner_streams_its_contribution_in() -> None:
    from test_contribution_admission import LEARNER, MANIFEST, SHAPES, _driver

    from diloco_node.learn.learner_thread import DueFragment

    sizes = {}
    for codec in ("int8", "fp32"):
        manifest = dataclasses.replace(MANIFEST, sync=dataclasses.replace(MANIFEST.sync, codec_up=codec))
        driver, syncer, _ = _driver({"lead": LEARNER}, manifest=manifest)  # we hold the lease: streamed to ourselves
        names = driver.plan.fragments[1].names
        rng = np.random.default_rng(0)
        delta = {n: rng.standard_normal(SHAPES[n]).astype(np.float32) for n in names}  # zstd cannot shrink it
        await driver._send_contribution(DueFragment(1, 0, 8, 8 * 32, delta, step=8))
        kept = syncer.rounds[1].pending["lead"][0].delta
        sizes[codec] = kept.encoded_bytes
        assert all(np.allclose(kept[n], delta[n], rtol=0, atol=0.05) for n in names)  # int8: half a scale step
    values = sum(int(np.prod(SHAPES[n])) for n in names)
    assert sizes["fp32"] >= 4 * values > 2 * sizes["int8"]  # 4 bytes a value, about 1 (+ block padding)


def test_codec_down_sizes_the_commit_checked_against_the_wire() -> None:
    from wire.limits import MAX_LOG_APPEND_BYTES

    limits = dict(max_log_append_bytes=MAX_LOG_APPEND_BYTES)
    shapes = {f"blocks.{i}.mlp.kernel": (12288, 12288) for i in range(8)}  # shapes only
    plan = plan_fragments(shapes, 8, 32, 1)
    assert wire_fit_problems(plan, shapes, "int4", "int4", **limits) == []
    # codec_up no longer matters (contributions are streamed in chunks); codec_down does
    assert wire_fit_problems(plan, shapes, "fp32", "int4", **limits) == []
    problems = wire_fit_problems(plan, shapes, "int4", "fp32", **limits)
    assert any("its commit (fp32" in p for p in problems)


def test_secret_file_is_the_run_secret_and_so_the_run_id(tmp_path: Path) -> None:
    from diloco_node.config.settings import run_id_for

    runs = {}
    for name, secret in (("one", SECRET_A), ("two", SECRET_B)):
        path = tmp_path / f"{name}.secret"
        path.write_bytes(secret + b"\n")
        path.chmod(0o600)
        config = load_config(None, {"DILOCO_SECRET_FILE": str(path), "DILOCO_DATA_DIR": str(tmp_path / "data")})
        assert config.read_secret() == secret
        runs[name] = run_id_for(config.read_secret())  # daemon/node.py: frames carry this run id
    assert runs["one"] != runs["two"]


# ------------------------------------------------------------------ [node.data] keys


def _text_site(root: Path, **changes: object):
    from diloco_node.config.site_data import SiteData
    from diloco_node.learn import data as data_lib

    return data_lib.open_site_data(SiteData(source="text", paths=(str(root / "*.txt"),), **changes), None)


def test_data_seed_and_eval_fraction_choose_the_held_out_files(tmp_path: Path) -> None:
    # Enough files to hold out whole files (learn/data.py MIN_FILES_FOR_PATH_SPLIT), and so many
    # that 5% of them is never none: the split hashes each file's path, and pytest's temporary
    # directory differs from run to run (with 60 files, 0.95^60 = 4.6% of runs held out nothing).
    for i in range(240):
        (tmp_path / f"part{i:03d}.txt").write_bytes(bytes([65 + i % 26]) * 100)
    base = _text_site(tmp_path, seed=0, eval_fraction=0.2)
    reseeded = _text_site(tmp_path, seed=1, eval_fraction=0.2)
    smaller = _text_site(tmp_path, seed=0, eval_fraction=0.05)
    assert base.eval_files and reseeded.eval_files and smaller.eval_files
    assert set(base.eval_files) != set(reseeded.eval_files)
    assert set(smaller.eval_files) < set(base.eval_files)  # same hash, a lower threshold
    assert base.eval.size == 100 * len(base.eval_files) and smaller.eval.size < base.eval.size


# ------------------------------------------------------------------ [run.model] keys and run.seed


def _signature(**changes: object) -> dict[str, tuple[int, ...]]:
    from diloco_node.config.manifest import ModelSpec
    from diloco_node.learn import factory

    spec = {"factory": "bytes", "vocab_size": 256, "seq_len": 16, "size": "tiny", "num_layers": 1, **changes}
    if spec["factory"] == "llama":
        spec.update(size="1m", d_model=64, d_ff=128)
    return {name: shape for name, shape, _ in factory.model_signature(ModelSpec.of(**spec))}


def test_model_factory_vocab_size_and_seq_len_shape_the_model() -> None:
    base = _signature()
    assert base["embed/embedding"][0] == 256 and base["pos_embed/embedding"][0] == 16
    assert _signature(vocab_size=512)["embed/embedding"][0] == 512
    assert _signature(seq_len=32)["pos_embed/embedding"][0] == 32
    llama = _signature(factory="llama")
    assert set(llama) != set(base) and "pos_embed/embedding" not in llama  # positions by rotation, no table


def test_run_seed_is_the_initial_model() -> None:
    from diloco_node.config.manifest import ModelSpec, RunManifest
    from diloco_node.learn import factory, model as model_lib

    spec = ModelSpec.of("bytes", vocab_size=256, seq_len=16, size="tiny", num_layers=1)
    first = {}
    for seed in (0, 0, 1):
        manifest = RunManifest(model=spec, seed=seed)
        # daemon/site_model.py: factory.init_params(manifest.model, manifest.seed)
        params = model_lib.flat_params(factory.init_params(manifest.model, manifest.seed)[1])
        if seed in first:
            assert all(np.array_equal(params[n], first[seed][n]) for n in params)
        first[seed] = params
    assert not np.array_equal(first[0]["embed/embedding"], first[1]["embed/embedding"])


# ------------------------------------------------------------------ [run.outer] keys


def _after_two_outer_steps(lr: float, momentum: float) -> np.ndarray:
    from diloco_node.config.manifest import OuterOptimizer
    from diloco_node.sync.global_state import GlobalState

    shapes = {"embed/embedding": (4, 2), "blocks/0/w": (2, 2)}
    initial = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    state = GlobalState(plan_fragments(shapes, 1, 4, 0), initial, OuterOptimizer(lr=lr, momentum=momentum))
    for scale in (1.0, -0.5):
        state.apply_outer_gradient(0, {name: np.full(shape, scale, np.float32) for name, shape in shapes.items()})
    return state.fragment_params(0)["blocks/0/w"]


def test_outer_lr_and_momentum_change_the_global_step() -> None:
    base = _after_two_outer_steps(0.7, 0.9)
    assert not np.allclose(base, _after_two_outer_steps(0.3, 0.9))
    assert not np.allclose(base, _after_two_outer_steps(0.7, 0.0))
    # Without momentum the two steps are plain SGD on the gradients: 1 - lr * (1 - 0.5).
    np.testing.assert_allclose(_after_two_outer_steps(0.7, 0.0), 1 - 0.7 * 0.5, rtol=1e-6)


def test_source_address_reaches_the_peer_client_options() -> None:
    assert plan_from(node_config()).client_options.source_address is None
    assert plan_from(node_config(source_address="127.0.0.23")).client_options.source_address == "127.0.0.23"
    # What the client does with it: tests/test_transport.py::test_the_client_connects_from_its_configured_source_address


def test_eval_batches_is_how_many_windows_each_evaluation_scores() -> None:
    from diloco_node.config.manifest import InnerOptimizer as Inner, ModelSpec, RunManifest
    from diloco_node.daemon.evaluation import HeldOutLoss

    manifest = RunManifest(model=ModelSpec.of("bytes", vocab_size=256, seq_len=16, size="tiny", num_layers=1),
                           inner=Inner(batch_size=4))
    tokens = (np.arange(20_000) % 251).astype(np.uint8)
    shapes = {}
    for batches in (2, 5):
        cfg = node_config(eval_batches=batches)
        # daemon/evaluation.py GlobalEvaluator(batches=cfg.eval_batches) -> HeldOutLoss
        shapes[batches] = HeldOutLoss(manifest, tokens, cfg.eval_batches).inputs.shape
    assert shapes == {2: (2, 4, 16), 5: (5, 4, 16)}


# ------------------------------------------------------------------ [run.sync] merge and weighting, through the Syncer


def _syncer_merge(**sync: object) -> np.ndarray:
    from diloco_node.config.manifest import OuterOptimizer, RunManifest, SyncSpec
    from diloco_node.sync.global_state import GlobalState
    from diloco_node.sync.merge import Contribution
    from diloco_node.sync.syncer import Syncer

    shapes = {"blocks/0/w": (8,)}
    manifest = RunManifest(sync=SyncSpec(fragments=1, period=4, overlap=0, min_quorum=1, codec_down="fp32", **sync))
    plan = plan_fragments(shapes, 1, 4, 0)
    state = GlobalState(plan, {"blocks/0/w": np.zeros(8, np.float32)}, OuterOptimizer())
    syncer = Syncer(manifest, plan, [])
    rng = np.random.default_rng(0)
    work = {"a": (4, 4 * 64), "b": (4, 4 * 64), "c": (16, 16 * 1024)}  # c did more work
    for learner, (steps, tokens) in work.items():
        delta = {"blocks/0/w": rng.standard_normal(8).astype(np.float32)}
        syncer.add(Contribution(learner, 0, 0, delta, steps, tokens), now=0.0)
    step = syncer.step_round(0, 0.0, list(work))
    assert step is not None and step.taken is not None
    merged = syncer.merge_round(step.taken, state)
    assert merged.outer_gradient is not None  # codec_down fp32: the merge's own bits
    return merged.outer_gradient["blocks/0/w"]


def test_sync_merge_and_weighting_change_the_merged_outer_gradient() -> None:
    rda_tokens = _syncer_merge(merge="rda", weighting="tokens")
    mean_tokens = _syncer_merge(merge="mean", weighting="tokens")
    mean_uniform = _syncer_merge(merge="mean", weighting="uniform")
    assert not np.allclose(rda_tokens, mean_tokens)
    assert not np.allclose(mean_tokens, mean_uniform)


# ------------------------------------------------------------------ keys the daemon reads before it opens anything


@pytest.mark.parametrize("role, member_role", [("learner", "learner"), ("witness", "witness")])
def test_node_id_and_role_are_what_the_daemon_calls_itself_and_how_it_joins(tmp_path: Path, role: str,
                                                                          member_role: str) -> None:
    from diloco_node.clock import FakeClock
    from diloco_node.daemon.node import Node
    from diloco_node.daemon.services import new_status
    from diloco_node.ops.tracking import Tracking

    effective = load_config(None, {"DILOCO_NODE_ID": f"site-{role}", "DILOCO_ROLE": role,
                                   "DILOCO_DATA_DIR": str(tmp_path)})
    daemon = Node(effective, environ={})
    assert daemon.node_id == f"site-{role}" and daemon.role.value == member_role  # the role it joins the run with
    served = new_status(daemon.cfg, "run", FakeClock(), Tracking()).document(0.0).to_dict()  # what /status serves
    assert served["node_id"] == f"site-{role}" and served["role"] == role


# ------------------------------------------------------------------ keys observed in the daemon itself
# (before issue 12's follow-up these were observed only by integration tests; each test below
# changes the key and watches the daemon's own code, in the default suite)


class _YieldingClock:
    """A fake monotonic clock whose sleep moves time on and lets other tasks run."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        import asyncio

        self.now += seconds
        await asyncio.sleep(0)


class _Horizon(Exception):
    pass


def _daemon(tmp_path: Path, clock: _YieldingClock, **overrides: str):
    from diloco_node.daemon.node import Node

    effective = load_config(None, {}, {"node_id": "a", "listen": "127.0.0.1:7070", "data_dir": str(tmp_path),
                                       **overrides})
    return Node(effective, environ={}, clock=clock)


@pytest.mark.parametrize("interval, checkpoints", [(10.0, 9), (30.0, 3)])
async def test_checkpoint_interval_s_is_how_often_the_daemon_checkpoints(tmp_path: Path, interval: float,
                                                                          checkpoints: int) -> None:
    """The daemon's periodic job (daemon/node.py `_periodic`) on a fake clock, for 100 s."""
    clock = _YieldingClock()
    taken: list[float] = []

    async def checkpoint() -> None:
        taken.append(clock.now)

    await _run_periodic(_daemon(tmp_path, clock, checkpoint_interval_s=str(interval)), checkpoint, until=1100.0)
    assert taken == [1000.0 + interval * (i + 1) for i in range(checkpoints)]


async def _run_periodic(daemon, checkpoint, *, until: float, refreshed: list[float] | None = None,
                        errors: list[str] | None = None) -> None:
    """The daemon's periodic loop with `checkpoint` as its checkpoint job, until the status refresh
    at `until` (each refresh's time goes to `refreshed`, each reported error to `errors`)."""
    from types import SimpleNamespace

    def refresh(now: float) -> None:
        if refreshed is not None:
            refreshed.append(now)
        if now >= until:
            raise _Horizon

    async def refresh_members(voters) -> None:
        pass

    daemon._ready = True
    daemon._update_readiness = lambda services, parts, now: None
    parts = SimpleNamespace(feed=SimpleNamespace(refresh=refresh), periodic_checkpoint=checkpoint,
                            core=SimpleNamespace(log=SimpleNamespace(config=SimpleNamespace(voters=()))))
    services = SimpleNamespace(identity=SimpleNamespace(refresh_members=refresh_members), node_id="a",
                               samples=SimpleNamespace(observe=lambda document: None), status_document=None,
                               report_error=(errors if errors is not None else []).append)
    with pytest.raises(_Horizon):
        await daemon._periodic(services, parts)


async def test_a_periodic_checkpoint_that_raises_is_tried_again_and_status_keeps_refreshing(tmp_path: Path) -> None:
    """checkpoint_interval_s after a failure: the job that raised is reported and tried again at the
    next interval, and the same loop keeps refreshing /status and readiness. Before, one exception
    (a compaction racing a snapshot install) ended the loop: /status froze at its last document."""
    clock = _YieldingClock()
    refreshed: list[float] = []
    taken: list[float] = []
    errors: list[str] = []

    async def checkpoint() -> None:
        taken.append(clock.now)
        if len(taken) == 1:
            raise AssertionError("the log moved past the compaction point")

    await _run_periodic(_daemon(tmp_path, clock, checkpoint_interval_s="10"), checkpoint, until=1050.0,
                        refreshed=refreshed, errors=errors)
    assert taken == [1010.0, 1020.0, 1030.0, 1040.0]  # the one that raised, then every interval on
    assert refreshed[-1] >= 1050.0 and len(refreshed) > 10
    assert errors == ["the periodic checkpoint failed: AssertionError: the log moved past the compaction point; "
                      "tried again at the next interval"]


@pytest.mark.parametrize("processes, timeout_s, warned, suspect", [
    (2, 8, True, "process 1"), (3, 8, True, "another of the site's processes"), (2, 40, False, "")])
async def test_cluster_heartbeat_timeout_and_num_processes_decide_when_and_whom_a_stalled_step_blames(
        tmp_path: Path, processes: int, timeout_s: int, warned: bool, suspect: str) -> None:
    """daemon/training.py `watch_cluster_learner`, run by the node: a learner stalled 5 s in one step
    is reported once a quarter of cluster.heartbeat_timeout_s has passed, naming the suspect by
    cluster.num_processes; its failure takes the site down."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from diloco_node.daemon.services import new_status
    from diloco_node.daemon.training import LearnerSlot
    from diloco_node.ops.tracking import Tracking

    clock = _YieldingClock()
    daemon = _daemon(tmp_path, clock, **{"cluster.num_processes": str(processes),
                                         "cluster.coordinator": "127.0.0.1:1234",
                                         "cluster.heartbeat_timeout_s": str(timeout_s)})
    learner = SimpleNamespace(error=None, steps=1, last_step_at=time.monotonic(), is_alive=lambda: True)
    slot = LearnerSlot()
    slot.fill(learner)  # type: ignore[arg-type]
    services = SimpleNamespace(slot=slot, status=new_status(daemon.cfg, "run", clock, Tracking()),
                               pools=SimpleNamespace(io=ThreadPoolExecutor(1)))
    watch = __import__("asyncio").ensure_future(daemon._watch_cluster_learner(services))
    for _ in range(4):  # the first checks see the learner train
        await clock.sleep(0.25)
    learner.steps, learner.last_step_at = 2, time.monotonic() - 5.0  # one step now stuck for 5 s
    for _ in range(8):
        await clock.sleep(0.25)
    learner.error = RuntimeError("collective failed")  # the site goes down: the watch ends
    await watch
    errors = [e.message for e in services.status.document(clock.now).last_errors]
    stalls = [e for e in errors if "waited" in e]
    assert bool(stalls) is warned
    if warned:
        assert f"may have lost {suspect}" in stalls[0]
        assert f"cluster.heartbeat_timeout_s = {timeout_s} s" in stalls[0]
    assert daemon._site_failed and "collective failed" in daemon.exit_reason


def test_cluster_keys_are_what_the_site_joins_its_jax_cluster_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """learn/cluster.py `initialize`: the three keys reach jax.distributed.initialize."""
    import jax

    from diloco_node.config.site_devices import ClusterSpec
    from diloco_node.learn import cluster

    calls: list[tuple] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    assert not cluster.initialize(ClusterSpec())  # one host: no cluster at all
    cluster.initialize(ClusterSpec("10.0.0.1:9000", num_processes=2, process_id=1, heartbeat_timeout_s=10))
    cluster.initialize(ClusterSpec("10.0.0.1:9000", num_processes=4, process_id=3, heartbeat_timeout_s=60))
    assert [(args, kwargs["heartbeat_timeout_seconds"]) for args, kwargs in calls] == [
        (("10.0.0.1:9000", 2, 1), 10), (("10.0.0.1:9000", 4, 3), 60)]


def test_cluster_process_id_above_0_is_a_follower_host_that_reads_no_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_root_logger: None) -> None:
    """cli/run.py: process 0 is the site (it needs the run secret); any other process only joins
    the site's JAX cluster, so a missing secret does not stop it."""
    from diloco_node import cli
    from diloco_node.learn import cluster

    class Joined(Exception):
        pass

    def joined(spec) -> bool:
        raise Joined(spec.process_id)

    monkeypatch.setattr(cluster, "initialize", joined)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))  # run() only sets defaults
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    for name in ("CREDENTIALS_DIRECTORY", "DILOCO_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    argv = ["run", "--node-id", "a", "--data-dir", str(tmp_path), "--set", "cluster.num_processes=2",
            "--set", "cluster.coordinator=127.0.0.1:1234"]
    assert cli.main([*argv, "--set", "cluster.process_id=0"]) == 2  # the site itself: no secret, exit 2
    with pytest.raises(Joined, match="1"):
        cli.main([*argv, "--set", "cluster.process_id=1"])


@pytest.mark.parametrize("advertise", ["http://10.1.2.3:7070", "http://site-a.example:9000"])
async def test_advertise_is_the_url_the_site_announces_to_members(tmp_path: Path, advertise: str) -> None:
    """daemon/identity.py: a site's own address book entry and the JoinRequest it announces."""
    from concurrent.futures import ThreadPoolExecutor

    from diloco_node.clock import FakeClock
    from diloco_node.config.manifest import RunManifest
    from diloco_node.daemon.identity import SiteIdentity
    from diloco_node.daemon.coordination_store import CoordinationStore
    from bootstrap.messages import MemberRole

    sent: list[tuple[str, object]] = []

    class Client:
        async def send(self, url, message, **kwargs):
            sent.append((url, message))
            return []

    effective = load_config(None, {}, {"node_id": "a", "listen": "127.0.0.1:7070", "advertise": advertise,
                                       "data_dir": str(tmp_path)})
    identity = SiteIdentity(effective, CoordinationStore(tmp_path / "coordination"), Client(), MemberRole.LEARNER,
                            clock=FakeClock(), executor=ThreadPoolExecutor(1))
    identity.manifest = RunManifest()
    identity.addresses.learn("b", "http://10.9.9.9:7070")
    await identity.announce()
    assert identity.addresses.url("a") == advertise
    assert [(url, m.node_id, m.advertise_url) for url, m in sent] == [("http://10.9.9.9:7070", "a", advertise)]


async def test_data_dir_is_where_the_daemon_keeps_its_state_and_finds_its_identity(tmp_path: Path) -> None:
    """daemon/node.py `run`: two data directories, each holding another node's identity: the daemon
    reads the one `data_dir` names, refuses it (exit 2, changing nothing) and made its stores there."""
    import json

    from diloco_node.daemon.node import Node
    from diloco_node.testbed.launcher import write_secret

    secret = write_secret(tmp_path / "secret")
    outcomes = {}
    for owner in ("b", "c"):
        data = tmp_path / f"data-{owner}"
        (data / "coordination").mkdir(parents=True)
        identity = {"node_id": owner, "role": "learner", "manifest": {}, "addresses": {}}
        (data / "coordination" / "identity.json").write_text(json.dumps(identity))
        port = free_port()
        effective = load_config(None, {}, {"node_id": "a", "listen": f"127.0.0.1:{port}", "data_dir": str(data),
                                           "secret_file": str(secret)})
        daemon = Node(effective, environ={})
        outcomes[owner] = (await daemon.run(), daemon.exit_reason, sorted(p.name for p in data.iterdir()))
        assert json.loads((data / "coordination" / "identity.json").read_text()) == identity  # unchanged
    for owner in ("b", "c"):
        code, reason, made = outcomes[owner]
        assert code == 2 and reason == f"data_dir {tmp_path / f'data-{owner}'} belongs to node {owner!r}, not 'a'"
        assert {"checkpoints", "coordination"} <= set(made)
