"""A multi-host site's other processes (`[node.cluster] process_id` > 0): the learner only.

Process 0 is the site to the rest of the run: it founds, joins or restarts, talks to peers,
keeps the replica and serves /status. Every other host runs this instead of the daemon: it
receives the run manifest from process 0, builds the same learner on the site's global mesh and
follows process 0 at every step boundary (learn/cluster.py), until process 0 decides to stop.
It opens no port and needs no run secret. If any process of the site dies the site goes down (a
dead process 0 makes JAX abort this one at once; a dead follower makes this one's learner fail
and exit 1) and comes back by restart (systemd restarts each host's unit; process 0 resumes from
its checkpoint and catches up like any restarted site).
"""

from __future__ import annotations

import json
import logging

from diloco_node.config.manifest import RunManifest
from diloco_node.config.settings import EffectiveConfig
from diloco_node.daemon.site_model import DATA_CACHE_DIR, open_learner_data
from diloco_node.learn import factory
from diloco_node.learn import model as model_lib
from diloco_node.learn.cluster import BoundaryFollowing, failure_reason, share_manifest
from diloco_node.learn.inner import InnerLearner
from diloco_node.learn.learner_thread import LearnerThread
from diloco_node.learn.mesh import build_site_mesh
from diloco_node.sync.fragments import plan_fragments

log = logging.getLogger("diloco_node.daemon")


def run_follower(effective: EffectiveConfig) -> int:
    """Train as one of process 0's followers; the exit code (0 when process 0 stopped us)."""
    cfg = effective.node
    log.info("%s: process %d of the site's cluster: waiting for process 0's run manifest", cfg.node_id,
             cfg.cluster.process_id)
    manifest = RunManifest.from_dict(json.loads(share_manifest(None)))
    # The same build, in the same order, as process 0's `build_site_model` and `prepare_learner`:
    # each step on the site's global arrays is a program every process runs together.
    corpus = open_learner_data(manifest, cfg.data, cfg.data_dir / DATA_CACHE_DIR)  # this host's own copy
    site_mesh = build_site_mesh(cfg.mesh)
    inner = InnerLearner(manifest.model, manifest.learner_inner(), manifest.seed, site_mesh=site_mesh)
    initial = model_lib.flat_params(factory.init_params(manifest.model, manifest.seed)[1])
    sync = manifest.sync
    plan = plan_fragments({n: a.shape for n, a in initial.items()}, sync.fragments, sync.period, sync.overlap)
    thread = LearnerThread(node_id=cfg.node_id, manifest=manifest, plan=plan, corpus=corpus, global_params=initial,
                           global_rounds=[0] * plan.num_fragments, on_contribution=lambda due: None,
                           on_progress=lambda step, loss, tokens: None, inner=inner,
                           following=BoundaryFollowing(plan.num_fragments))
    seconds = thread.compile()
    log.info("%s: training step compiled in %.1f s on %s; following process 0", cfg.node_id, seconds,
             site_mesh.describe())
    thread.start()
    thread.begin_training()
    thread.join()
    if thread.error is not None:
        log.error("%s: process %d: the site is going down: %s", cfg.node_id, cfg.cluster.process_id,
                  failure_reason(thread.error))
        return 1
    log.info("%s: process 0 stopped the site at step %d", cfg.node_id, thread.steps)
    return 0
