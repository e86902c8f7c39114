"""A site's device mesh gives the same loss curve on 1 and 4 devices (data-parallel, and FSDP with
microbatches): one subprocess with 4 forced host devices, as the device count is fixed when JAX
starts. Two devices run in-process, where the suite forces two (tests/test_mesh.py: axis sizes,
the layout rule and the global batch; tests/test_sharded_startup.py: two sharded devices train to
a one-device start's losses), so this process compiles no 2-device learner of its own."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration


LOSS_CURVES = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from diloco_node.config.manifest import InnerOptimizer, ModelSpec
    from diloco_node.learn.inner import InnerLearner
    from diloco_node.learn.mesh import MeshShape, build_site_mesh
    spec = ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1, d_model=64, d_ff=128)
    inner = InnerOptimizer(batch_size=8, lr_peak=3e-2, warmup_steps=1, total_steps=20)
    # Two batches, each seen twice: memorisable, so the curve must go down.
    batches = [np.random.default_rng(i % 2).integers(0, 256, (8, 17)).astype(np.int32) for i in range(4)]
    curves = {}
    for name, devices, shape in [("1", 1, MeshShape()), ("4", 4, MeshShape()),
                                 ("4 fsdp=2 microbatches=2", 4, MeshShape(fsdp=2, microbatches=2))]:
        mesh = build_site_mesh(shape, jax.devices()[:devices], min_sharded_elements=1)
        learner = InnerLearner(spec, inner, seed=7, site_mesh=mesh)
        curves[name] = [float(learner.step(b[:, :-1], b[:, 1:])) for b in batches]
    print(json.dumps(curves))
""")


def test_one_manifest_gives_the_same_loss_curve_on_1_and_4_devices():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", LOSS_CURVES], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    curves = json.loads(done.stdout.strip().splitlines()[-1])
    reference = np.array(curves["1"])
    assert reference[-1] < reference[0]  # it trains
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, reference, rtol=1e-5, err_msg=f"loss curve on {name} device(s)")
