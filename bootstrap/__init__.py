"""bootstrap: joining a run and membership (sans-IO state machines).

Membership and SWIM failure detection (`membership`), epochs, votes and the coordinator lease
(`election`), the replicated commit log (`replog`), composed per site by `coordinator_node`;
`simulation` runs them deterministically under faults. Protocol and safety argument:
docs/COORDINATION.md.
"""
