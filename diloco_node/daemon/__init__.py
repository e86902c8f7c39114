"""The `diloco-node run` daemon: the composition root that wires I/O to the sans-IO cores.

`node.py` builds the parts and runs the lifecycle; `identity.py` (found, join or restart),
`coordination.py` (the coordination core's I/O), `rounds.py` (the fragment round on the real
clock), `state_transfer.py` (applying commits, downloads, snapshot installs, repairs),
`persistence.py` (checkpoints, compaction, the restart rule), `readiness.py` (ready or why not),
`status_feed.py` (the status document), `site_model.py` (model, replica and syncer from the
manifest), `peers.py` (coordination messages <-> wire messages, addresses), `join.py` (the join
handshake and the state download), `coordination_store.py` (durable coordination state), `exits.py`
(the exit statuses, permanent or transient).
"""
