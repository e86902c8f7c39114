"""diloco_node: the daemon — learner (JAX), syncer, coordination, HTTP API and CLI."""

__version__ = "0.1.0"
