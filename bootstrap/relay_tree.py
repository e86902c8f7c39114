"""Relay trees: who forwards a committed entry's payload to whom, so the lease holder sends it a bounded number of times.

Authority does not move through the tree. The lease holder's own `AppendEntries` still reaches
every follower directly and still carries each entry's metadata and the digest of its payload;
only the payload bytes (the large part: a merged fragment delta) travel down the tree. A follower
persists and acknowledges an entry only when it holds payload bytes whose digest equals the one
the holder signed, so a relay can delay bytes but cannot alter them undetected, and commit still
means "a majority of voters persisted it in the holder's epoch". That is why the tree keeps
Raft's safety: it changes where bytes come from, never what is agreed on (`docs/COORDINATION.md`).

This module only plans. `plan_relay_tree` is a pure function of the holder, the followers, the
fan-out and which followers are unhealthy, so every node computes the same tree from the same
inputs. `fetch_sources` gives a follower the order in which to ask for a payload it has not
received: its parent first, then each ancestor, and the holder last, so a relay that dies, stalls
or is cut off costs its subtree at most one `relay_timeout_s` per level before the bytes come from
higher up. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from wire.errors import LocalProtocolError

# Copies of each payload the lease holder sends itself. With 2 the holder's uplink carries twice
# the delta per commit whatever the number of sites, and a tree of 16 sites is 4 levels deep.
DEFAULT_FANOUT = 2
# Largest fan-out we accept: beyond this a "tree" is the holder sending to everyone again.
MAX_FANOUT = 16


@dataclass(frozen=True, slots=True)
class RelayTree:
    """A rooted tree over the run's members: `parent[m]` sends payloads to `m`; the root is the lease holder."""

    root: str
    fanout: int
    parent: Mapping[str, str]
    children: Mapping[str, tuple[str, ...]]

    def depth(self, member: str) -> int:
        """Hops from the root to `member` (0 for the root)."""
        hops = 0
        while member != self.root:
            member = self._parent_of(member)
            hops += 1
        return hops

    @property
    def height(self) -> int:
        """The largest depth of any member: how many hops the last payload copy takes."""
        return max((self.depth(m) for m in self.parent), default=0)

    def fetch_sources(self, member: str) -> tuple[str, ...]:
        """Whom `member` asks for a missing payload, in order: its parent, each ancestor, the root last."""
        sources: list[str] = []
        node = member
        while node != self.root:
            node = self._parent_of(node)
            sources.append(node)
        return tuple(sources)

    def sends_of(self, member: str) -> int:
        """How many copies of each payload `member` sends down the tree."""
        return len(self.children.get(member, ()))

    def describe(self) -> str:
        """One line, e.g. `a -> [b, c]; b -> [d, e]`, for logs and /status."""
        parts = [f"{node} -> [{', '.join(kids)}]" for node, kids in sorted(self.children.items()) if kids]
        return "; ".join(parts) if parts else f"{self.root} alone"

    def _parent_of(self, member: str) -> str:
        try:
            return self.parent[member]
        except KeyError:
            raise LocalProtocolError(f"{member!r} is not in the relay tree rooted at {self.root!r}") from None


def plan_relay_tree(root: str, followers: Iterable[str], fanout: int = DEFAULT_FANOUT,
                    unhealthy: Iterable[str] = ()) -> RelayTree:
    """The relay tree rooted at the lease holder `root`, every node sending to at most `fanout` others.

    Healthy followers are placed breadth-first in id order, so the tree is the same on every node
    and as shallow as the fan-out allows. Unhealthy followers (suspected by the failure detector,
    or whose relaying stalled) are placed after every healthy one: they still receive payloads,
    and relay only when every healthy node already sends `fanout` copies. The fan-out bound
    holds for every node, the root included; a stalled relay's subtree falls back to the
    ancestors in `fetch_sources`.
    """
    if not isinstance(root, str) or not root:
        raise LocalProtocolError(f"relay tree root must be a non-empty node id, got {root!r}")
    if type(fanout) is not int or not 1 <= fanout <= MAX_FANOUT:
        raise LocalProtocolError(f"relay fan-out must be an int in [1, {MAX_FANOUT}], got {fanout!r}")
    members = sorted(set(followers) - {root})
    suspect = set(unhealthy)
    healthy = [m for m in members if m not in suspect]
    weak = [m for m in members if m in suspect]

    children: dict[str, list[str]] = {root: []}
    parent: dict[str, str] = {}
    # Breadth-first: each node in `frontier` takes up to `fanout` children before the next one does.
    # Unhealthy members come last, so they are leaves whenever the healthy ones have room, and
    # relay only when there are too many of them for the rest to carry within the fan-out.
    frontier = [root]
    cursor = 0
    for member in healthy + weak:
        while len(children[frontier[cursor]]) >= fanout:
            cursor += 1
        holder = frontier[cursor]
        children[holder].append(member)
        children[member] = []
        parent[member] = holder
        frontier.append(member)

    return RelayTree(
        root=root,
        fanout=fanout,
        parent=MappingProxyType(parent),
        children=MappingProxyType({node: tuple(kids) for node, kids in children.items()}),
    )


def worst_case_fetch_delay(tree: RelayTree, member: str, relay_timeout_s: float) -> float:
    """Longest wait before `member` asks the root itself, when every ancestor relay is dead or stalled."""
    if not relay_timeout_s > 0:
        raise LocalProtocolError(f"relay timeout must be > 0 seconds, got {relay_timeout_s!r}")
    return relay_timeout_s * (len(tree.fetch_sources(member)) - 1)
