"""The algorithm, sans-IO: fragments, the fragment round (syncer, quorum and grace), the merge, the
outer step, the replicated global state and the learner's apply rule. No I/O and no clock here:
callers pass `now` and get decisions with reasons back."""
