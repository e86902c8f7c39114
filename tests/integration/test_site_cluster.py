"""A multi-host site on one machine: 2 processes x 2 CPU devices form one JAX cluster over gloo on
loopback (`learn/cluster.py`). Process 0's training thread takes merged fragments and checkpoint
requests; process 1 follows its decisions at every step boundary. Both must train in lockstep:
the same steps, the same losses, and bit-identical copies of the (replicated over `data`)
parameters in each process's own device memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import free_port, local_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
HOST_DEVICES = "--xla_force_host_platform_device_count=2"
# How long the two workers may take, start-up to exit: about 20 s alone, 3.5-5 min on two cores
# shared with eight other test runs (a generous bound, never a speed claim).
WAIT_S = 420

WORKER = textwrap.dedent("""
    import faulthandler, hashlib, json, os, sys, threading, time
    from pathlib import Path
    port, process_id, out, dump_after_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    started = time.monotonic()
    # Where every thread is, shortly before the test gives up on this process: slow or stuck?
    faulthandler.dump_traceback_later(dump_after_s, exit=False)

    def mark(what):
        print(f"{time.monotonic() - started:.1f} s: {what}", flush=True)

    import jax, numpy as np
    from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
    from diloco_node.config.site_devices import ClusterSpec, MeshShape
    from diloco_node.learn import cluster, data as data_lib, factory, model as model_lib
    from diloco_node.daemon.evaluation import HeldOutLoss
    from diloco_node.learn.figures import FIGURES_WINDOW_S
    from diloco_node.learn.inner import InnerLearner
    from diloco_node.learn.learner_thread import LearnerThread, snapshot_meta_and_arrays
    from diloco_node.ops.checkpoint import write_checkpoint_file
    from diloco_node.learn.mesh import build_site_mesh
    from diloco_node.sync.fragments import plan_fragments

    mark("imported")
    assert cluster.initialize(ClusterSpec(f"127.0.0.1:{port}", 2, process_id), initialization_timeout_s=120)
    manifest = RunManifest(
        model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128),
        inner=InnerOptimizer(batch_size=8, lr_peak=1e-2, warmup_steps=1, total_steps=100),
        sync=SyncSpec(fragments=2, period=2, overlap=1))
    corpus = data_lib.Corpus(np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8),
                             np.arange(512, dtype=np.uint8), 256, "random bytes")
    # data across the two processes, fsdp over each process's own two devices
    mesh = build_site_mesh(MeshShape(data=2, fsdp=2), min_sharded_elements=1)
    inner = InnerLearner(manifest.model, manifest.inner, manifest.seed, site_mesh=mesh)
    initial = model_lib.flat_params(factory.init_params(manifest.model, manifest.seed)[1])
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, 2, 2, 1)
    following = cluster.BoundaryFollowing(plan.num_fragments)
    holder, sent, losses, snaps, windows = {}, [], [], [], []
    rounds = [0, 0]

    def contribution(due):  # process 0 only: a merged fragment comes straight back
        sent.append(due.fragment)
        rounds[due.fragment] += 1
        merged = {n: (initial[n] - 0.5 * d).astype(np.float32) for n, d in due.delta.items()}
        holder["t"].offer_fragment(due.fragment, rounds[due.fragment], merged, contributors=("a",))

    def progress(step, loss, tokens):
        losses.append(loss)
        figures = holder["t"].figures  # set before this report when the step closed a window
        if figures is not None and (not windows or windows[-1]["step"] != figures.step):
            windows.append({"step": figures.step, "lr": figures.lr, "grad_norm": figures.grad_norm,
                            "grad_norm_step": figures.grad_norm_step,
                            "schedule_lr": inner.learning_rate(figures.step)})
        if process_id == 0 and step == 5:
            snaps.append(holder["t"].request_state())  # a checkpoint request mid-run
        # Past three figures windows (each process closes its own, on its own clock: both have
        # closed at least two when process 0 stops the site).
        if step % 10 == 0:
            mark(f"step {step}, {len(windows)} figures windows")
        if process_id == 0 and step >= 12 and len(windows) >= 3:
            holder["t"].stop()

    # Paced: the steps of this tiny model take milliseconds, the figures windows seconds.
    thread = holder["t"] = LearnerThread(node_id="a", manifest=manifest, plan=plan, corpus=corpus,
                                         global_params=initial, global_rounds=[0, 0], on_contribution=contribution,
                                         on_progress=progress, inner=inner, following=following,
                                         min_step_interval_s=FIGURES_WINDOW_S / 8)
    mark("built")
    thread.compile()
    mark("compiled")
    thread.start()
    thread.begin_training()
    thread.join(WAIT_S)
    mark(f"trained {thread.steps} steps")
    if thread.is_alive() or thread.error is not None:
        # Out at once, past JAX's exit barrier (which a failed peer never reaches): the other
        # process's next collective then fails instead of waiting for this one forever.
        import traceback
        traceback.print_exception(thread.error) if thread.error is not None else print("the learner hung")
        sys.stdout.flush()
        os._exit(1)

    def local_copy(array):  # this process's own full replica, from its own shards only
        full = np.zeros(array.shape, np.float32)
        for shard in array.addressable_shards:
            full[shard.index] = np.asarray(shard.data)
        return full

    leaves = jax.tree.leaves(thread._inner.params)
    digest = hashlib.sha256(b"".join(local_copy(leaf).tobytes() for leaf in leaves)).hexdigest()
    result = {"steps": thread.steps, "losses": losses, "digest": digest, "rounds": thread.base_rounds,
              "sent": len(sent), "devices": mesh.describe(), "windows": windows}
    # Every process holds the state its last boundary gathered: it evaluates and checkpoints it
    # as process 0's daemon does (the held-out loss of those weights; the checkpoint file).
    final = thread.request_state().result(timeout=10)
    result["eval_loss"] = HeldOutLoss(manifest, corpus.eval, 2)(final.params)
    meta, arrays = snapshot_meta_and_arrays(final)
    result["checkpoint_bytes"] = write_checkpoint_file(Path(out).with_suffix(".ckpt"), 1, meta, arrays)
    result["final_params"] = hashlib.sha256(b"".join(final.params[n].tobytes() for n in sorted(final.params))).hexdigest()
    if process_id == 0:
        snap = snaps[0].result(timeout=10)
        result["snapshot_step"] = snap.step
        result["final_step"] = final.step  # after the end: the last boundary's copy
        result["final_matches_local"] = all(
            np.array_equal(final.params[n], local_copy(leaves[i])) for n, i in thread._leaf_index.items())
    with open(out, "w") as handle:
        json.dump(result, handle)
""")


# In the default suite: the only test that runs a follower's figures, eval and checkpoint state.
# Under load it once failed in one run of five: a process that compiled the step more than 30 s
# after the other failed the first collective's gloo set-up (the worker then hung at JAX's exit
# barrier); the processes now meet before it (learn/cluster.py `meet`), and a failed worker exits
# at once.
@pytest.mark.timeout(WAIT_S + 120)
def test_two_processes_of_one_site_train_in_lockstep_and_follow_process_0(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("WAIT_S", str(WAIT_S)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    # Two CPU devices per process. Not XLA's one-thread limit: a device's all-reduce waits for
    # one thread per local device, and a one-thread pool can deadlock (benchmarks/learner.py).
    env.update(XLA_FLAGS=HOST_DEVICES, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    processes = []
    for i in range(2):
        with open(logs[i], "w") as log:
            processes.append(subprocess.Popen([sys.executable, str(script), str(port), str(i), str(tmp_path / f"p{i}.json"),
                                               str(WAIT_S - 20)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            if any(p.poll() not in (None, 0) for p in processes):
                time.sleep(5)  # one failed: the other's collective fails soon after, or it is killed
                break
            time.sleep(0.2)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(
        f"--- process {i} (exit {p.returncode}):\n{outputs[i][-4000:]}" for i, p in enumerate(processes))
    leader, follower = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))
    assert leader["devices"] == {"platform": "cpu", "count": 4, "processes": 2, "mesh": {"data": 2, "fsdp": 2},
                                 "kind": "cpu", "attention": "auto", "remat": "none"}
    assert leader["steps"] == follower["steps"] >= 12
    assert leader["losses"] == follower["losses"]
    assert leader["digest"] == follower["digest"]  # every merged fragment reached both processes
    assert leader["sent"] >= 4 and min(leader["rounds"]) >= 2 and follower["sent"] == 0
    assert leader["snapshot_step"] >= 5 and leader["final_step"] == leader["steps"]
    assert leader["final_matches_local"]
    for result in (leader, follower):
        # Both processes closed figures windows (the follower's first one is where a device read of
        # another process's array used to kill it), each with a gradient norm and the schedule's lr.
        assert len(result["windows"]) >= 2 and result["windows"][-1]["grad_norm"] > 0, result["windows"]
        for window in result["windows"]:
            # (a window that closed at the first step has no finished step's norm yet: a slow start)
            assert window["grad_norm_step"] == 0 or window["grad_norm"] > 0, window
            assert window["grad_norm_step"] == window["step"] - 1
            assert window["lr"] == pytest.approx(window["schedule_lr"]) and window["lr"] > 0
        assert result["checkpoint_bytes"] > 0
    # The same gathered state on both: the same checkpointed weights and the same held-out loss.
    assert leader["final_params"] == follower["final_params"]
    assert leader["eval_loss"] == follower["eval_loss"] > 0


@pytest.mark.slow  # ~25 s on two cores: kept out of the default suite (-m slow runs it)
def test_diloco_node_run_on_two_hosts_is_one_site_whose_process_0_is_the_daemon(tmp_path):
    """`diloco-node run` twice with one config but `cluster.process_id` 0 and 1: process 0 founds
    a run and shows both hosts' devices on /status; process 1 follows; SIGTERM to process 0 stops
    the site (both exit 0)."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    http, coordinator = free_port(), free_port()
    common = ["--node-id", "a", "--listen", f"127.0.0.1:{http}", "--secret-file", str(secret),
              "--data-dir", str(tmp_path / "data"), "--set", "run.model.size=tiny", "--set", "run.model.seq_len=32",
              "--set", "run.inner.batch_size=4", "--set", "run.sync.fragments=2", "--set", "run.sync.period=4",
              "--set", f"cluster.coordinator=127.0.0.1:{coordinator}", "--set", "cluster.num_processes=2",
              "--set", "eval_interval_commits=0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(XLA_FLAGS=HOST_DEVICES, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), DILOCO_X_MIN_STEP_S="0.05")
    launch = "import sys; from diloco_node import cli; sys.exit(cli.main(sys.argv[1:]))"
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    processes = [subprocess.Popen([sys.executable, "-c", launch, "run", *common, "--set", f"cluster.process_id={i}"],
                                  env=env, stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
    try:
        seen = None
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and all(p.poll() is None for p in processes):
            seen = local_status(http)
            if seen and seen["learner"]["step"] >= 12 and seen["commit_index"] >= 2:
                break
            time.sleep(1)
        assert seen is not None and seen["learner"]["step"] >= 12 and seen["commit_index"] >= 2, (
            seen, (tmp_path / "process0.log").read_text()[-3000:], (tmp_path / "process1.log").read_text()[-3000:])
        assert seen["devices"] == {"platform": "cpu", "count": 4, "processes": 2, "mesh": {"data": 4, "fsdp": 1}}
        processes[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        for handle in logs:
            handle.close()
    follower_log = (tmp_path / "process1.log").read_text()
    assert codes == [0, 0], (tmp_path / "process0.log").read_text()[-3000:] + follower_log[-3000:]
    assert "process 0 stopped the site" in follower_log
