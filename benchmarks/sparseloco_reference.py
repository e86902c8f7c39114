"""An independent reference for sparse outer gradients: SparseLoCo's algorithm, written from the
paper (arXiv 2508.15706) with none of the daemon's sync code, to tell the algorithm's gap at this
size from our implementation's.

Synchronous DiLoCo: M learners each take H inner steps from the global model Theta, then learner m
forms its outer gradient Delta_m = Theta - theta_m, and

    x_m = beta * e_m + Delta_m        error feedback (the remainder decays by beta)
    q_m = TopK2(x_m)                  per 4,096-value chunk of each tensor: its k largest magnitudes,
                                      each as a sign and one of two magnitude levels of the chunk
    e_m = x_m - q_m                   what was not sent waits for the next round
    Theta <- Theta - alpha * mean_m q_m            plain mean over the M learners, outer SGD
    theta_m <- Theta                  every learner restarts from the new global model

The whole model is one fragment; there is no syncer, no quorum, no codec bytes. `--dense` is the
same code without compression (q_m = Delta_m, no remainder): its loss against the sparse run is
the algorithm's gap at this size. The model, data shards, inner optimizer (AdamW and its schedule,
whose state each learner keeps across rounds) and eval set are those of `benchmarks/parity.py`.

Two choices the paper leaves to the implementer, made here as simply as the paper allows: the two
levels of a chunk are the mean magnitude of the lower and of the upper half of its k selected
values (the wire codec picks the split that minimises the squared error instead), and a tensor's
last chunk shorter than C (all of a norm's or bias's 64 values) is sent as it is (the wire codec
sends it at int4). Both touch a few hundred of 140,544 values.

Every round is logged (and kept in the JSON) with the diagnostics the runner reports too
(`sim/sparse_diagnostics.py`): the remainder's norm over the outer gradient's, the fraction of
coordinates sent at least once, the cosine between what was sent and the uncompressed outer
gradient, and the merged update's norm over the dense mean's.

    .venv/bin/python benchmarks/sparseloco_reference.py --seeds 0,1                 # sparse, beta 0.95
    .venv/bin/python benchmarks/sparseloco_reference.py --seeds 0,1 --dense         # its dense twin
    .venv/bin/python benchmarks/sparseloco_reference.py --seed 0 --period 15 --outer-lr 1 --json /tmp/r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from diloco_node.learn import data as data_lib  # noqa: E402
from diloco_node.learn import factory  # noqa: E402
from diloco_node.learn import model as model_lib  # noqa: E402
from diloco_node.learn.inner import StackedLearners, make_schedule  # noqa: E402
from diloco_node.cli.train import default_manifest  # noqa: E402

# SparseLoCo's compression: the top 64 of every chunk of 4,096 values, two bits each.
CHUNK = 4096
TOP_K = 64
EVAL_BATCHES = 64  # as benchmarks/parity.py
EVAL_BATCH_SIZE = 32
GLOBAL_BATCH = 32  # windows per step over all learners, as benchmarks/parity.py


def top_k_two_level(x: np.ndarray, k: int = TOP_K, chunk: int = CHUNK) -> np.ndarray:
    """What a receiver gets of tensor x: per whole chunk of `chunk` values (flattened), its k
    largest magnitudes as sign x one of two levels (the means of the lower and upper half of the
    selected magnitudes), zeros elsewhere; a shorter last chunk as it is."""
    flat = np.asarray(x, np.float32).reshape(-1)
    out = np.zeros_like(flat)
    whole = flat.size // chunk
    if whole:
        rows = flat[:whole * chunk].reshape(whole, chunk)
        idx = np.argpartition(-np.abs(rows), k - 1, axis=1)[:, :k]
        chosen = np.take_along_axis(rows, idx, axis=1)
        mags = np.abs(chosen)
        order = np.sort(mags, axis=1)
        half = k // 2
        low = order[:, :half].mean(axis=1, keepdims=True)
        high = order[:, half:].mean(axis=1, keepdims=True)
        split = order[:, half - 1:half] if half else order[:, :1]  # the lower half's largest
        level = np.where(mags > split, high, low)
        np.put_along_axis(out[:whole * chunk].reshape(whole, chunk), idx, np.sign(chosen) * level, axis=1)
    out[whole * chunk:] = flat[whole * chunk:]
    return out.reshape(np.shape(x))


def _norm(tree: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.dot(a.reshape(-1).astype(np.float64), a.reshape(-1).astype(np.float64)))
                         for a in tree.values()))


def _dot(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return sum(float(np.dot(a[n].reshape(-1).astype(np.float64), b[n].reshape(-1).astype(np.float64))) for n in a)


@dataclasses.dataclass
class Settings:
    seed: int = 0
    steps: int = 600  # inner steps per learner
    learners: int = 4
    period: int = 28  # H
    beta: float = 0.95
    top_k: int = TOP_K
    outer_lr: float = 1.0
    outer_momentum: float = 0.0  # Nesterov; 0: SparseLoCo's plain SGD
    dense: bool = False
    error_feedback: bool = True
    # Scale the remainder by min(1, inner lr now / inner lr at the previous send) before adding the
    # new delta: the remainder is displacement made at a larger step size than the delta's.
    lr_scaled_remainder: bool = False


def run(s: Settings, corpus: data_lib.Corpus | None = None, log=print) -> dict:
    started = time.perf_counter()
    corpus = corpus or data_lib.stdlib_corpus(seed=s.seed)
    manifest = default_manifest(s.steps, s.seed)
    inner = dataclasses.replace(manifest.inner, batch_size=GLOBAL_BATCH // s.learners,
                                total_steps=max(s.steps, manifest.inner.warmup_steps + 1))
    model = factory.recipe(manifest.model)
    seq_len = manifest.model.seq_len
    shards = data_lib.shard_bounds(len(corpus.train), s.learners)
    samplers = [data_lib.BatchSampler(corpus.train[a:b], inner.batch_size, seq_len, manifest.seed, m)
                for m, (a, b) in enumerate(shards)]
    eval_in, eval_tg = data_lib.eval_batches(corpus.eval, EVAL_BATCHES, EVAL_BATCH_SIZE, seq_len)
    _, params = factory.init_params(model, manifest.seed)
    theta = {n: np.array(a, np.float32) for n, a in model_lib.flat_params(params).items()}
    stack = StackedLearners(model, inner, s.learners, manifest.seed, theta)
    mask = np.ones(s.learners, dtype=bool)
    schedule = make_schedule(inner)
    previous_lr = float(schedule(0))
    remainders = [{n: np.zeros_like(a) for n, a in theta.items()} for _ in range(s.learners)]
    sent_ever = {n: np.zeros(a.shape, bool) for n, a in theta.items()}
    momentum = {n: np.zeros_like(a) for n, a in theta.items()}
    rounds, done = [], 0
    while done < s.steps:
        h = min(s.period, s.steps - done)
        for _ in range(h):
            batches = [sampler.next() for sampler in samplers]
            stack.step(np.stack([b[0] for b in batches]), np.stack([b[1] for b in batches]), mask)
        done += h
        deltas = [{n: theta[n] - a for n, a in stack.get_flat(m).items()} for m in range(s.learners)]
        lr_now = float(schedule(done))
        decay = s.beta * (min(1.0, lr_now / previous_lr) if s.lr_scaled_remainder and previous_lr > 0 else 1.0)
        previous_lr = lr_now
        sent = []
        for m, delta in enumerate(deltas):
            if s.dense:
                sent.append(delta)
                continue
            e = remainders[m]
            x = {n: (decay * e[n] + d if s.error_feedback else d).astype(np.float32) for n, d in delta.items()}
            q = {n: top_k_two_level(v, s.top_k) for n, v in x.items()}
            remainders[m] = {n: x[n] - q[n] for n in x}
            for n in q:
                sent_ever[n] |= q[n] != 0
            sent.append(q)
        mean_sent = {n: np.mean([q[n] for q in sent], axis=0) for n in theta}
        mean_delta = {n: np.mean([d[n] for d in deltas], axis=0) for n in theta}
        stats = {
            "round": len(rounds) + 1, "step": done,
            "remainder_over_delta": float(np.mean([_norm(remainders[m]) / max(_norm(deltas[m]), 1e-30)
                                                   for m in range(s.learners)])) if not s.dense else 0.0,
            "sent_ever": (sum(int(v.sum()) for v in sent_ever.values()) / sum(v.size for v in sent_ever.values())
                          if not s.dense else 1.0),
            "cosine_sent_delta": float(np.mean([_dot(sent[m], deltas[m]) / max(_norm(sent[m]) * _norm(deltas[m]), 1e-30)
                                                for m in range(s.learners)])),
            "merged_over_dense": _norm(mean_sent) / max(_norm(mean_delta), 1e-30),
        }
        rounds.append(stats)
        for n in theta:  # outer SGD, Nesterov when outer_momentum > 0
            momentum[n] = s.outer_momentum * momentum[n] + mean_sent[n]
            theta[n] = (theta[n] - s.outer_lr * (mean_sent[n] + s.outer_momentum * momentum[n])).astype(np.float32)
        for m in range(s.learners):
            stack.set_flat(m, theta)
        log(f"round {stats['round']:3d} step {done:5d}  remainder/delta {stats['remainder_over_delta']:.3f}  "
            f"sent ever {stats['sent_ever']:.3f}  cos(sent, delta) {stats['cosine_sent_delta']:.3f}  "
            f"|merged|/|dense mean| {stats['merged_over_dense']:.3f}", flush=True)
    evaluate = factory.eval_fn(model)
    loaded = model_lib.load_flat_params(stack.learner_params(0), theta)
    losses = [float(evaluate(loaded, eval_in[i:i + 1], eval_tg[i:i + 1])) for i in range(len(eval_in))]
    return {"settings": dataclasses.asdict(s), "eval_loss": round(float(np.mean(losses)), 4),
            "eval_loss_stderr": round(float(np.std(losses, ddof=1) / math.sqrt(len(losses))), 4),
            "eval_batch_losses": [round(x, 5) for x in losses], "rounds": rounds,
            "wall_s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--period", type=int, default=28, help="H, inner steps per round")
    parser.add_argument("--beta", type=float, default=0.95, help="error-feedback decay")
    parser.add_argument("--top-k", type=int, default=TOP_K, help=f"values kept per chunk of {CHUNK}")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov momentum (0: plain SGD)")
    parser.add_argument("--dense", action="store_true", help="the dense twin: no compression")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--lr-scaled-remainder", action="store_true",
                        help="scale the remainder by min(1, inner lr now / at the previous send)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    out = []
    for seed in seeds:
        s = Settings(seed=seed, steps=args.steps, learners=args.learners, period=args.period, beta=args.beta,
                     top_k=args.top_k, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                     dense=args.dense, error_feedback=not args.no_error_feedback,
                     lr_scaled_remainder=args.lr_scaled_remainder)
        result = run(s)
        print(f"seed {seed} {'dense' if s.dense else 'sparse'} H {s.period} beta {s.beta} k {s.top_k} "
              f"outer lr {s.outer_lr} momentum {s.outer_momentum}: eval_loss {result['eval_loss']:.4f}"
              f"±{result['eval_loss_stderr']:.4f}  wall {result['wall_s']:.0f}s", flush=True)
        out.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
