"""bootstrap: joining a run and membership (sans-IO state machines)."""
