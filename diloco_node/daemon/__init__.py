"""The `diloco-node run` daemon: the composition root that wires I/O to the sans-IO cores.

`node.py` is the composition root; `peers.py` maps coordination messages to wire messages;
`replica_store.py` makes the coordination state durable; `replica.py` applies committed outer
steps to the replicated global state; `syncer.py` collects and merges contributions as lease
holder; `learner_thread.py` trains in one dedicated thread; `join.py` joins a running run.
"""
