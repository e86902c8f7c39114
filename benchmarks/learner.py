"""Learner throughput: the daemon's training thread against a plain jitted loop of the same model.

    .venv/bin/python benchmarks/learner.py --json learner.json                       # llama, preset 1m
    .venv/bin/python benchmarks/learner.py --factory bytes --option size=tiny --steps 300
    .venv/bin/python benchmarks/learner.py --devices 1,4 --host-devices 4 --json l.json  # CPU: 4 forced devices
    .venv/bin/python benchmarks/learner.py --devices 8 --mesh-fsdp 2                  # a GPU host (jax[cuda12])
    .venv/bin/python benchmarks/learner.py --option size=1b --option compute_dtype=\"bfloat16\" \
        --vocab-size 128256 --seq-len 2048 --batch-size 8 --fragments 24 --period 24 --attention cudnn

Nothing here is specific to a platform: it trains on whatever devices JAX finds (install the
`cuda12` or `tpu` extra on an accelerator host). `--host-devices N` is for CPU only: it forces N
host devices with one thread each, before JAX starts (several JAX users share small machines).

Each `--devices` count is a site mesh over the first N devices (`data` = N / fsdp, `fsdp` =
`--mesh-fsdp`), the global batch split over them. Both sides train the same model on the same
mesh with the same batches:

- plain: `InnerLearner.step` in a loop over pre-sampled batches, `PLAIN_QUEUE_DEPTH` steps queued
  ahead (the device never waits for the host: the fastest a loop of this jitted step can go);
- daemon: a `LearnerThread` exactly as a site runs it: step boundaries, sampling, due deltas
  handed to a stand-in for the event loop that encodes them with the run's codec on another
  thread (as the daemon's codec pool does) and, a round trip later, offers a merged fragment back,
  which the thread applies at its next boundary. Fragment traffic flows the whole time.

Reported per device count: steps/s, tokens/s and MFU (learn/flops.py: the model's training FLOPs
per token over the devices' peak; n/a on a CPU) of each, and their ratio (daemon / plain; the target is >= 0.95,
the goal 0.98: best run over best run, and the median of each daemon run over the plain run just
before it), the offers applied (to show traffic flowed), the training thread's own host time per
step (`host_ms_per_step` p50 and p99: everything the thread does between waiting on one step and
dispatching the next, wall time; the device idles once it exceeds the step's device time; and the
same steps' CPU time of the thread, `host_cpu_ms_per_step`, which a loaded machine does not
inflate; and `step_dispatch_cpu_ms`, the CPU time of the plain loop's `learner.step` calls: the
jitted call's own dispatch), the
device-to-host bytes of the due fragments against their float32 size (int4 is encoded on the
device: codes and scales only), and the cost of reading one due fragment (device copy, transfer,
delta; and the int4 program's dispatch and landing on the host) and writing one merged fragment
(placed with each tensor's sharding) on the mesh; and the share of wall time with no training step
in flight, plain and daemon (`StepWatch`: backend-neutral, from dispatch and completion times, an
upper bound of the device's idle time). Each side runs `--repeats` times, alternating; the best run of
each side is compared (the machine's noise only slows runs down).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import queue
import sys
import threading
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _force_host_devices(argv: list[str]) -> None:
    """`--host-devices N` (CPU only) must reach XLA before JAX is imported."""
    for i, arg in enumerate(argv):
        count = arg.split("=", 1)[1] if arg.startswith("--host-devices=") else (
            argv[i + 1] if arg == "--host-devices" and i + 1 < len(argv) else None)
        if count:
            os.environ["JAX_PLATFORMS"] = "cpu"
            # One XLA thread per process keeps a 1-device run steady on a shared small machine. Not
            # with several devices: their all-reduces rendezvous one thread per device, and with
            # steps queued ahead a small pool deadlocks (measured: "Expected 4 threads to join the
            # rendezvous, but only 3 of them arrived", then XLA aborts).
            limits = " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" if int(count) == 1 else ""
            os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(count)}{limits}"


_force_host_devices(sys.argv[1:])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec  # noqa: E402
from diloco_node.learn import data as data_lib  # noqa: E402
from diloco_node.learn import factory  # noqa: E402
from diloco_node.learn import flops as flops_lib  # noqa: E402
from diloco_node.learn import model as model_lib  # noqa: E402
from diloco_node.learn.inner import InnerLearner  # noqa: E402
from diloco_node.learn.device_quantize import EncodedTensor, delta_program  # noqa: E402
from diloco_node.learn.learner_thread import DueFragment, LearnerThread, _copy_fragment  # noqa: E402
from diloco_node.learn.mesh import MeshShape, SiteMesh, build_site_mesh, host_view, place  # noqa: E402
from diloco_node.sync.fragments import plan_fragments  # noqa: E402
from wire.contribution_stream import contribution_chunks, open_for  # noqa: E402

WARMUP_STEPS = 10
# Steps the plain loop lets JAX queue ahead (the daemon's learner keeps about as many). Two keep a
# device always fed; an unbounded queue of multi-device steps deadlocks XLA:CPU's in-process
# all-reduce (measured with 4 host devices: aborts after ~40 queued steps).
PLAIN_QUEUE_DEPTH = 2


def build_manifest(args: argparse.Namespace) -> RunManifest:
    options = {}
    for item in args.option:
        key, _, text = item.partition("=")
        try:
            options[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            options[key] = text
    model = ModelSpec.of(args.factory, vocab_size=args.vocab_size, seq_len=args.seq_len, **options)
    return RunManifest(model=model, inner=InnerOptimizer(batch_size=args.batch_size, warmup_steps=10,
                                                         total_steps=10_000),
                       sync=SyncSpec(fragments=args.fragments, period=args.period, overlap=1))


def tokens_for(manifest: RunManifest) -> np.ndarray:
    """Random token ids below the vocabulary: throughput does not depend on the text."""
    return np.random.default_rng(0).integers(0, manifest.model.vocab_size, 2_000_000, dtype=np.int64).astype(np.uint32)


class StepWatch:
    """When each step was dispatched and when it was seen done: `learner.step` is wrapped to stamp
    the dispatch, and a watcher thread blocks on each step's loss in turn and stamps its return.

    `idle_fraction(start, end)` is the share of that wall time with zero steps in flight (none
    dispatched and not yet done): the device had no training step to run. Backend-neutral (it
    uses only dispatch and `block_until_ready`); an upper bound of the device's idle time, since
    a step is seen done a thread wake-up after it is, and other device work (a due fragment's
    program, an install) counts as idle here.
    """

    def __init__(self, learner: InnerLearner) -> None:
        self.spans: list[list[float]] = []  # [dispatched, done] per step, in dispatch order
        self._queue: queue.Queue[tuple[list[float], jax.Array] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._watch, name="step-watch", daemon=True)
        self._thread.start()
        step = learner.step

        def watched(inputs: np.ndarray, targets: np.ndarray) -> jax.Array:
            span = [time.perf_counter(), float("inf")]
            loss = step(inputs, targets)
            self.spans.append(span)
            self._queue.put((span, loss))
            return loss

        learner.step = watched  # type: ignore[method-assign]

    def _watch(self) -> None:
        while (item := self._queue.get()) is not None:
            span, loss = item
            jax.block_until_ready(loss)
            span[1] = time.perf_counter()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(60)

    def idle_fraction(self, start: float, end: float) -> float:
        busy, covered_to = 0.0, start
        for dispatched, done in self.spans:  # dispatch order: the spans' starts never decrease
            lo, hi = max(dispatched, covered_to), min(done, end)
            if hi > lo:
                busy += hi - lo
                covered_to = hi
        return 1.0 - busy / (end - start)


@dataclasses.dataclass
class PlainRun:
    steps_per_s: float
    idle_fraction: float  # wall time with zero steps in flight (`StepWatch`)
    dispatch_cpu_ms: list[float]  # the thread's CPU time in each `learner.step` call (the dispatch)


def plain_loop(manifest: RunManifest, tokens: np.ndarray, steps: int, mesh: SiteMesh) -> PlainRun:
    learner = InnerLearner(manifest.model, manifest.inner, manifest.seed, site_mesh=mesh)
    sampler = data_lib.BatchSampler(tokens, manifest.inner.batch_size, manifest.model.seq_len, 0)
    batches = [sampler.next() for _ in range(WARMUP_STEPS + steps)]
    for x, y in batches[:WARMUP_STEPS]:
        jax.block_until_ready(learner.step(x, y))
    watch = StepWatch(learner)
    started = time.perf_counter()
    in_flight: list[jax.Array] = []
    dispatch_cpu_ms = []
    for x, y in batches[WARMUP_STEPS:]:
        cpu_started = time.thread_time()
        in_flight.append(learner.step(x, y))
        dispatch_cpu_ms.append(1e3 * (time.thread_time() - cpu_started))
        if len(in_flight) > PLAIN_QUEUE_DEPTH:
            jax.block_until_ready(in_flight.pop(0))
    jax.block_until_ready(in_flight)
    ended = time.perf_counter()
    watch.close()
    return PlainRun(steps / (ended - started), watch.idle_fraction(started, ended), dispatch_cpu_ms)


class NetworkStandIn:
    """The event loop's side of the learner: encodes each due delta on its own thread (the codec
    pool) and, `round_trip_s` later, offers the fragment back as a merged version."""

    def __init__(self, manifest: RunManifest, round_trip_s: float) -> None:
        self.manifest = manifest
        self.round_trip_s = round_trip_s
        self.inbox: queue.Queue[DueFragment | None] = queue.Queue()
        self.learner: LearnerThread | None = None
        self.rounds: dict[int, int] = {}
        self.offers = 0
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, name="network-stand-in", daemon=True)

    def on_contribution(self, due: DueFragment) -> None:
        self.inbox.put(due)

    def _run(self) -> None:
        while (due := self.inbox.get()) is not None:
            # The contribution's chunks as the daemon's codec pool makes them: an int4 delta comes
            # encoded on the device (learn/device_quantize.py) and its bytes are framed as they are.
            head = open_for({n: np.shape(d) for n, d in due.delta.items()}, fragment=due.fragment, base_index=0,
                            base_round=due.base_round, c_steps=due.c_steps, c_tokens=due.c_tokens,
                            codec=self.manifest.sync.codec_up, learner_id="bench", stream=bytes(16))
            self.bytes += sum(len(chunk.payload) for chunk in contribution_chunks(head, due.delta))
            delta = {n: np.asarray(d) for n, d in due.delta.items()}  # for the stand-in's merge only
            time.sleep(self.round_trip_s)
            assert self.learner is not None
            round_ = self.rounds.get(due.fragment, 0) + 1
            self.rounds[due.fragment] = round_
            # A "merged" fragment: the learner's own base moved by half its delta (a valid state).
            merged = {n: np.asarray(self.base[n] - 0.5 * d, np.float32) for n, d in delta.items()}
            self.base.update(merged)
            self.learner.offer_fragment(due.fragment, round_, merged, contributors=("bench",))
            self.offers += 1


@dataclasses.dataclass
class DaemonRun:
    steps_per_s: float
    offers: int
    bytes_encoded: int
    host_ms: list[float]  # the training thread's host time of each measured step (wall)
    host_cpu_ms: list[float]  # the same steps' CPU time of the training thread
    due_transfer_bytes: int  # device-to-host bytes of the due fragments (int4: codes and scales)
    due_fp32_bytes: int  # the same fragments' float32 size
    dues: int
    idle_fraction: float  # wall time with zero steps in flight (`StepWatch`)


def daemon_learner(manifest: RunManifest, tokens: np.ndarray, steps: int, round_trip_s: float,
                   mesh: SiteMesh) -> DaemonRun:
    inner = InnerLearner(manifest.model, manifest.inner, manifest.seed, site_mesh=mesh)
    initial = inner.get_flat()  # one host copy, as a founding site's replica takes it
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, manifest.sync.fragments, manifest.sync.period,
                          manifest.sync.overlap)
    cut = len(tokens) - len(tokens) // 20
    corpus = data_lib.Corpus(tokens[:cut], tokens[cut:], manifest.model.vocab_size, "random tokens")
    network = NetworkStandIn(manifest, round_trip_s)
    network.base = dict(initial)  # type: ignore[attr-defined]
    learner = LearnerThread(node_id="bench", manifest=manifest, plan=plan, corpus=corpus, global_params=initial,
                            global_rounds=[0] * plan.num_fragments, on_contribution=network.on_contribution,
                            on_progress=lambda *progress: None, inner=inner)
    network.learner = learner
    learner.compile()
    watch = StepWatch(inner)
    network.thread.start()
    learner.start()
    learner.begin_training()
    while learner.steps < WARMUP_STEPS:
        time.sleep(0.001)
    first, started = learner.steps, time.perf_counter()
    while learner.steps < first + steps:
        time.sleep(0.001)
    ended = time.perf_counter()
    elapsed = ended - started
    counted = learner.steps - first
    learner.stop()
    learner.join(60)
    watch.close()
    # One host time per step, oldest first (read once the thread is done: it appends to them).
    times = list(learner.host_seconds)
    offset = learner.steps - len(times)
    host_ms = [1e3 * s for s in times[max(0, first - offset):first + counted - offset]]
    cpu_times = list(learner.host_cpu_seconds)
    host_cpu_ms = [1e3 * s for s in cpu_times[max(0, first - offset):first + counted - offset]]
    network.inbox.put(None)
    network.thread.join(10)
    if learner.error is not None:
        raise RuntimeError(f"the learner thread failed: {learner.error!r}")
    return DaemonRun(counted / elapsed, network.offers, network.bytes, host_ms, host_cpu_ms, learner.due_transfer_bytes,
                     learner.due_fp32_bytes, sum(network.rounds.values()), watch.idle_fraction(started, ended))


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def fragment_costs(manifest: RunManifest, mesh: SiteMesh, repeats: int = 20) -> dict[str, float]:
    """Milliseconds to read the largest fragment off the mesh (one device copy, the transfer to
    the host, the delta) and to write a merged one back (each tensor placed with its sharding)."""
    learner = InnerLearner(manifest.model, manifest.inner, manifest.seed, site_mesh=mesh)
    by_name = {model_lib.path_name(path): leaf[...] for path, leaf in nnx.to_flat_state(learner.params)}
    flat = {n: np.asarray(a) for n, a in by_name.items()}
    plan = plan_fragments({n: a.shape for n, a in flat.items()}, manifest.sync.fragments, manifest.sync.period,
                          manifest.sync.overlap)
    names = max((f.names for f in plan.fragments), key=lambda ns: sum(flat[n].size for n in ns))
    arrays = {n: by_name[n] for n in names}
    base = {n: flat[n] for n in names}
    jax.block_until_ready(_copy_fragment(arrays))
    reads, writes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        copies = _copy_fragment(arrays)
        for array in copies.values():
            array.copy_to_host_async()
        _ = {n: np.subtract(base[n], host_view(copies[n]), dtype=np.float32) for n in names}  # as the learner does
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        placed = {n: place(base[n], arrays[n].sharding) for n in names}
        jax.block_until_ready(placed)
        writes.append(time.perf_counter() - started)
    # The int4 path: the training thread only dispatches the fragment's program and starts the
    # transfer (`dispatch`); the codes and scales reach the host later (`to host`).
    program = delta_program(tuple(names))
    device_base = {n: place(base[n], arrays[n].sharding) for n in names}
    jax.block_until_ready(program(device_base, arrays))
    dispatches, landed, transfer = [], [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        encoded = program(device_base, arrays)
        for parts in encoded.values():
            for array in parts:
                array.copy_to_host_async()
        dispatches.append(time.perf_counter() - started)
        tensors = [EncodedTensor(n, arrays[n].shape, *encoded[n]) for n in names]
        for tensor in tensors:
            tensor.host_parts()
        landed.append(time.perf_counter() - started)
        transfer = sum(t.transfer_bytes for t in tensors)
    return {"fragment_tensors": len(names), "fragment_bytes": int(sum(flat[n].nbytes for n in names)),
            "read_ms_median": 1e3 * float(np.median(reads)), "write_ms_median": 1e3 * float(np.median(writes)),
            "int4_dispatch_ms_median": 1e3 * float(np.median(dispatches)),
            "int4_to_host_ms_median": 1e3 * float(np.median(landed)), "int4_transfer_bytes": transfer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factory", default="llama")
    parser.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                        help="a [run.model] option (default for llama: size=1m)")
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="the site's global batch")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--period", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--round-trip-ms", type=float, default=50.0, help="delay before a merged fragment comes back")
    parser.add_argument("--devices", default="1", help="device counts to measure, e.g. 1,4 (the first N devices)")
    parser.add_argument("--mesh-fsdp", type=int, default=1, help="the mesh's fsdp axis size (the rest is data)")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--attention", default="auto", help="[node.mesh] attention (auto, xla, cudnn, chunked, reference)")
    parser.add_argument("--remat", default="none", help="[node.mesh] remat (none, full, dots)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="peak TFLOP/s of one device for MFU (0: from the table of known devices)")
    parser.add_argument("--host-devices", type=int, default=None,
                        help="CPU only: force this many host devices (read before JAX starts)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.option is None:
        args.option = ["size=1m"] if args.factory == "llama" else []
    manifest = build_manifest(args)
    tokens = tokens_for(manifest)
    results = []
    for count in [int(c) for c in args.devices.split(",")]:
        devices = jax.devices()[:count]
        if len(devices) < count:
            parser.error(f"--devices {count}: JAX sees only {len(jax.devices())} device(s)")
        mesh = build_site_mesh(MeshShape(data=-1, fsdp=args.mesh_fsdp, microbatches=args.microbatches,
                                         attention=args.attention, remat=args.remat), devices)
        tokens_per_step = args.batch_size * args.seq_len
        flops_per_token = flops_lib.flops_per_token(manifest.model)
        peak = flops_lib.peak_flops_per_device(str(getattr(devices[0], "device_kind", "")), args.peak_tflops)

        def mfu_of(steps_per_s: float) -> float | None:
            return flops_lib.mfu(steps_per_s * tokens_per_step, flops_per_token, len(devices), peak)

        def shown(steps_per_s: float) -> str:
            value = mfu_of(steps_per_s)
            return (f"{steps_per_s:.2f} steps/s, {steps_per_s * tokens_per_step:,.0f} tokens/s, MFU "
                    + (f"{100 * value:.1f}%" if value is not None else "n/a (no known peak)"))

        plain_runs, daemon_runs, host_ms, host_cpu_ms, offers, sent = [], [], [], [], 0, 0
        plain_idle, daemon_idle, dispatch_cpu_ms = [], [], []
        run: DaemonRun | None = None
        for _ in range(args.repeats):
            started = time.perf_counter()
            plain = plain_loop(manifest, tokens, args.steps, mesh)
            plain_runs.append(plain.steps_per_s)
            plain_idle.append(plain.idle_fraction)
            dispatch_cpu_ms += plain.dispatch_cpu_ms
            gc.collect()  # the plain loop's model and optimizer state leave the devices before the next
            print(f"{count} device(s): plain {shown(plain_runs[-1])} (the run with its start-up and compilation: "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
            started = time.perf_counter()
            run = daemon_learner(manifest, tokens, args.steps, args.round_trip_ms / 1000, mesh)
            rate, offers, sent = run.steps_per_s, run.offers, run.bytes_encoded
            host_ms += run.host_ms
            host_cpu_ms += run.host_cpu_ms
            daemon_idle.append(run.idle_fraction)
            gc.collect()
            daemon_runs.append(rate)
            print(f"{count} device(s): daemon learner {shown(rate)} ({offers} merged fragments applied, "
                  f"{sent / 1e6:.1f} MB encoded; the run with its start-up: {time.perf_counter() - started:.0f} s)",
                  flush=True)
        ratio = max(daemon_runs) / max(plain_runs)
        # Each daemon run right after its plain run sees about the same machine load: the median
        # of those pairs' ratios resists a shared machine's drifting load better than best/best.
        pair_ratio = float(np.median([d / p for d, p in zip(daemon_runs, plain_runs)]))
        costs = fragment_costs(manifest, mesh)
        gc.collect()
        results.append({"devices": mesh.describe(), "plain_steps_per_s": plain_runs,
                        "daemon_steps_per_s": daemon_runs, "ratio_best": ratio, "ratio_median_of_pairs": pair_ratio,
                        "tokens_per_step": tokens_per_step, "flops_per_token": flops_per_token,
                        "peak_flops_per_device": peak,
                        "plain_tokens_per_s_best": max(plain_runs) * tokens_per_step,
                        "daemon_tokens_per_s_best": max(daemon_runs) * tokens_per_step,
                        "plain_mfu_best": mfu_of(max(plain_runs)), "daemon_mfu_best": mfu_of(max(daemon_runs)),
                        "offers_applied_last_run": offers, "bytes_encoded_last_run": sent, "fragment": costs,
                        "host_ms_per_step": percentiles_ms(host_ms),
                        "host_cpu_ms_per_step": percentiles_ms(host_cpu_ms),
                        "step_dispatch_cpu_ms": percentiles_ms(dispatch_cpu_ms),
                        "plain_idle_fraction": plain_idle, "daemon_idle_fraction": daemon_idle,
                        "due_fragments_last_run": run.dues if run else 0,
                        "device_to_host_bytes_last_run": run.due_transfer_bytes if run else 0,
                        "due_fp32_bytes_last_run": run.due_fp32_bytes if run else 0})
        host, host_cpu = percentiles_ms(host_ms), percentiles_ms(host_cpu_ms)
        print(f"{count} device(s): daemon learner / plain loop: {ratio:.3f} best/best, {pair_ratio:.3f} median of "
              f"pairs (target >= 0.95, goal 0.98); best: plain {shown(max(plain_runs))}, daemon "
              f"{shown(max(daemon_runs))}; one "
              f"fragment ({costs['fragment_bytes'] / 1e6:.1f} MB): read {costs['read_ms_median']:.2f} ms, "
              f"write {costs['write_ms_median']:.2f} ms; int4 on the device: dispatch "
              f"{costs['int4_dispatch_ms_median']:.2f} ms, on the host after {costs['int4_to_host_ms_median']:.2f} ms, "
              f"{costs['int4_transfer_bytes'] / max(costs['fragment_bytes'], 1):.3f} of the fp32 bytes; "
              f"host_ms_per_step p50 {host['p50']:.3f} ms, p99 {host['p99']:.3f} ms (the thread's CPU time: p50 "
              f"{host_cpu['p50']:.3f} ms, p99 {host_cpu['p99']:.3f} ms; the step's dispatch alone, in the plain loop: "
              f"p50 {percentiles_ms(dispatch_cpu_ms)['p50']:.3f} ms); wall time with no step in flight: plain "
              f"{', '.join(f'{x:.3f}' for x in plain_idle)}, daemon {', '.join(f'{x:.3f}' for x in daemon_idle)}",
              flush=True)
    report = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "jax": jax.__version__,
        "model": dataclasses.asdict(manifest.model) | {"tensors": len(factory.model_signature(manifest.model))},
        "device": str(jax.devices()[0]), "steps": args.steps, "batch": [args.batch_size, args.seq_len],
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
