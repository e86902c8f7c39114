"""The pieces of a multi-host site that run without a cluster: the boundary decision's encoding,
the collectives on a one-process site (they must be identities), and a one-host site's
initialisation (nothing). The 2-process x 2-device site is tests/integration/test_site_cluster.py."""

import jax
import numpy as np
import pytest

from diloco_node.config.site_devices import ClusterSpec
from diloco_node.learn import cluster
from diloco_node.learn.cluster import APPLY_AFTER_READ, APPLY_NONE, APPLY_WRITE, BoundaryDecision, BoundaryFollowing


def test_a_decision_round_trips_through_its_fixed_size_encoding():
    decision = BoundaryDecision(stop=True, snapshot=False, apply=(APPLY_NONE, APPLY_WRITE, APPLY_AFTER_READ))
    encoded = decision.encode(3)
    assert encoded.dtype == np.int32 and encoded.shape == (5,)
    assert BoundaryDecision.decode(encoded) == decision
    assert BoundaryDecision.decode(BoundaryDecision().encode(2)) == BoundaryDecision(apply=(APPLY_NONE, APPLY_NONE))
    with pytest.raises(ValueError, match="decision for 3 fragments, the plan has 2"):
        decision.encode(2)


def test_on_a_one_process_site_the_collectives_hand_back_what_process_0_gave():
    following = BoundaryFollowing(num_fragments=2)
    assert following.leader and following.process_count == 1
    decision = BoundaryDecision(snapshot=True, apply=(APPLY_WRITE, APPLY_NONE))
    assert following.decide(decision) == decision
    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_array_equal(following.share(values, {"w": ((2, 3), np.float32)})["w"], values["w"])
    assert following.share_text("sampler state ✓") == "sampler state ✓"
    assert following.share_text("") == ""
    gathered = following.gather({"w": jax.numpy.asarray(values["w"])})
    np.testing.assert_array_equal(gathered["w"], values["w"])
    with pytest.raises(ValueError, match="process 0 must decide"):
        following.decide(None)


def test_a_one_host_site_initialises_no_cluster():
    assert ClusterSpec().enabled is False
    assert cluster.initialize(ClusterSpec()) is False
    assert ClusterSpec(coordinator="auto").enabled and ClusterSpec("h:1", 2, 1).enabled


def test_without_a_cluster_no_process_is_reported_lost_and_the_reason_says_so():
    assert cluster.lost_processes(timeout_s=1.0) is None
    reason = cluster.failure_reason(RuntimeError("Gloo all-reduce failed: Connection reset by peer\nmore"))
    assert reason == ("a collective of the site's JAX cluster failed (no process reported lost): "
                      "RuntimeError: Gloo all-reduce failed: Connection reset by peer")


def test_without_a_cluster_a_meeting_returns_at_once():
    cluster.meet("nobody-else")  # one process: nothing to wait for


# The modules whose code a multi-host site's follower runs on its training thread.
FOLLOWER_MODULES = ("learn/learner_thread.py", "learn/inner.py", "learn/figures.py", "learn/cluster.py",
                    "daemon/site_follower.py")


def test_the_follower_never_picks_a_device_from_the_global_list():
    """`jax.devices()[i]` on a multi-host site may be another process's device: a value computed
    there cannot be fetched (process 1 of a site died in its first figures window this way, reading
    the lr computed on `jax.devices("cpu")[0]`). Local devices or host numbers only; the mesh
    (learn/mesh.py) is where the global list belongs."""
    from pathlib import Path

    import diloco_node

    package = Path(diloco_node.__file__).parent
    offending = [f"{module}:{n}" for module in FOLLOWER_MODULES
                 for n, line in enumerate((package / module).read_text().splitlines(), 1)
                 if "jax.devices(" in line and not line.lstrip().startswith("#")]
    assert offending == []
