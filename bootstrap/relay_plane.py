"""One node's side of relayed payloads: commit bytes travel down a relay tree, authority does not.

The lease holder's `AppendEntries` still goes to every follower directly, but as metadata: each
entry's payload is known to the follower only by its digest (BLAKE3, wire/digest.py). The bytes are pushed once per entry
down the relay tree (`bootstrap.relay_tree`); every node that receives them keeps them (in the
daemon, its log files) and passes them to its children. A follower hands its state machine the
longest prefix of the holder's entries for which it holds bytes with the digest the holder named
(an empty prefix is a heartbeat: the lease is renewed and the commit index advances over what it
already has, so waiting for bytes never starts an election). So a relay can delay bytes but never
change them: bytes whose digest differs from the holder's are dropped on arrival (`refused`).
`docs/COORDINATION.md` ("Relayed payloads") says why this keeps Raft's safety.

Two classes, both sans-IO (events and `now` in, actions out; the payload store is injected):

- `RelayFollower` decides, by digest alone, everything about bytes this node lacks or is asked
  for: what it wants, when it wakes, whom it fetches from (parent, each ancestor, the holder last:
  `RelayTree.fetch_sources`), what a fetch answer means, what it promises others (bytes it is
  receiving or awaiting as a fresh commit, within `MAX_PROMISED_*`), how long it trusts a promise
  made to it (`PROMISE_TIMEOUTS`, `PROMISE_BYTES_PER_S`) and when it gives up (`GIVE_UP_S`). Every
  action carries its reason, and the latest decisions are kept for /status. The daemon
  (`diloco_node/daemon/relays.py`) performs these actions over HTTP; the coordination simulation
  performs them over its faulty network, on every simulated node.
- `PayloadRelay` is the rest of a node's relay: as lease holder it pushes each new payload to the
  tree's first level; on arrival it checks the bytes, keeps them and passes them on to its
  children; in the simulation it also holds appends until their bytes are here (the daemon holds
  the HTTP request instead) and answers the part it can take at most once per `partial_every_s`
  per holder unless that part grew (or every answer would make the holder resend the same entries
  at once). It feeds its `follower` the wants and arrivals.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

from bootstrap.entries import LogEntry
from bootstrap.messages import AppendEntries
from bootstrap.relay_tree import RelayTree
from wire import digest as content_digest
from wire.errors import LocalProtocolError

# A follower answers an append it cannot complete yet at most this often per holder, unless the
# part it can take grew: often enough to renew the holder's lease (heartbeats are 0.5 s apart by
# default), rarely enough that the holder's "send the rest at once" reaction does not loop.
DEFAULT_PARTIAL_EVERY_S = 0.25
# Seconds without a payload before a follower asks the next source up the tree.
DEFAULT_RELAY_TIMEOUT_S = 0.5
# Held-back messages per node; the holder resends anyway, so dropping the oldest loses only time.
MAX_WAITING_MESSAGES = 16
# Digests a holder remembers having pushed (32 B each, most recent first kept). An entry older than
# the last few thousand commits that is sent again goes down the tree again: extra traffic for a
# follower that far behind, never a safety question (the bytes are still checked by digest).
MAX_PUSHED_DIGESTS = 4096
# A want ends when no append has named its digest for this long (the holder moved on, or the
# entry left the log): its wakes stop, and the promises it backed end with it.
GIVE_UP_S = 30.0
# A fetch for bytes a relay is itself receiving or awaiting as a fresh commit is promised, not
# declined: the asker is served when they arrive. Payloads and askers per payload promised at once
# (a tree's children and a few catching-up members; past either bound the asker is declined and
# climbs on).
MAX_PROMISED_PAYLOADS = 16
MAX_PROMISED_ASKERS = 32
# An asker whose fetch was accepted waits this many relay timeouts, plus the payload's time at the
# planned relay rate below, before it climbs to the next source: a parent still receiving the bytes
# is no stall, and climbing to the holder would cost the holder's uplink another copy; a parent
# that died after promising is routed around after that bounded wait.
PROMISE_TIMEOUTS = 4
PROMISE_BYTES_PER_S = 16 * 1024 * 1024
# Decisions a follower keeps with their reasons (shown on /status, newest first).
MAX_RECENT_DECISIONS = 16


def payload_digest(payload: bytes) -> bytes:
    return content_digest.digest(payload)


def short(digest: bytes) -> str:
    """A digest as logs and /status show it."""
    return digest.hex()[:8]


class PayloadStore(Protocol):
    """Where a node keeps payload bytes by digest (the daemon: spool and log files; the simulation: a dict).

    What it keeps is opaque here: bytes, or the host's handle to bytes it verified itself (a
    daemon receiving a streamed payload hashes it chunk by chunk and hands over a spool file).
    """

    def get(self, digest: bytes) -> Any | None: ...

    def put(self, digest: bytes, payload: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Metadata:
    """An `AppendEntries` in flight without its payloads' bytes, and the tree the holder planned."""

    message: AppendEntries
    tree: RelayTree

    def digests(self) -> list[bytes]:
        return [payload_digest(e.payload_bytes()) for e in self.message.entries if e.payload_size]


@dataclass(frozen=True, slots=True)
class PayloadHop:
    """Payload bytes claimed to have `digest`; `tree` says where to pass them on (None: a fetch answer).

    `payload` is bytes, or (`on_verified`) the host's handle to bytes it already checked.
    """

    digest: bytes
    payload: Any
    tree: RelayTree | None


@dataclass(frozen=True, slots=True)
class PayloadRequest:
    requester: str
    digest: bytes


class FetchAnswer(Enum):
    """What became of a fetch, as the asker's host saw it."""

    ACCEPTED = "accepted"  # the bytes stream back now, or once the source has them (a promise)
    DECLINED = "declined"  # the source will not send them (it holds none and awaits none: 404)
    UNREACHABLE = "unreachable"  # no answer: the source is down, cut off or stalled past the deadline


# ---------------------------------------------------------------- actions for the host


@dataclass(frozen=True, slots=True)
class SendPayload:
    """Pass bytes on down a tree (`hop.tree`), or as the holder push them to its first level."""

    to: str
    hop: PayloadHop


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand this (possibly shortened) append to the node's coordination core."""

    message: AppendEntries


@dataclass(frozen=True, slots=True)
class Fetch:
    """Ask `to` for the bytes of `digest`; report what became of it with `on_fetch_answer`."""

    to: str
    digest: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Serve:
    """Send the stored bytes of `digest` to `to`, without a tree (a fetch answer, or a promise kept)."""

    to: str
    digest: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Promise:
    """Accept `to`'s fetch without sending anything yet: the bytes follow when they arrive here."""

    to: str
    digest: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Decline:
    """Refuse `to`'s fetch (the daemon: 404): nothing here and nothing on the way."""

    to: str
    digest: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Call `on_wake(digest, now)` at local time `at`."""

    at: float
    digest: bytes


@dataclass(frozen=True, slots=True)
class Release:
    """Whoever waits for the bytes of `digest` stops waiting: they are here, or the follower gave up."""

    digest: bytes
    reason: str


FollowerAction = Fetch | Serve | Promise | Decline | WakeAt | Release
RelayAction = SendPayload | Deliver | FollowerAction


# ---------------------------------------------------------------- the follower


@dataclass(slots=True)
class _Want:
    """Bytes this node lacks: whose append named them, and how far the fetching has got."""

    holder: str
    last_wanted: float
    # Already committed when first wanted: its push went out long ago (this node was down or still
    # starting), so waiting a relay timeout for it is pointless, and a promise is not worth waiting
    # on (between two members both behind, it would hold each of many payloads up to its window).
    catching_up: bool
    size: int = 0  # the payload's declared size (0: not known)
    attempt: int = 0  # fetches sent so far: the next source is fetch_sources[attempt]
    promised_until: float = float("-inf")  # a source accepted our fetch: its bytes are due until then
    promised_by: str = ""
    seen: int = -1  # stream bytes received by the last wake (a moving stream is no stall)


class RelayFollower:
    """One node's digest-only relay decisions: wants, wakes, fetches, promises, give-up and climb.

    Events (`now` in, the node's local monotonic time) and the actions they return:
    - `want(digest, holder, now, catching_up=, size=)`: an append names bytes not here. A fresh
      commit waits one relay timeout for its push (`WakeAt`); a committed one is fetched at once.
    - `on_wake(digest, now)`: still missing. Gives up after `GIVE_UP_S` without a want (`Release`);
      waits on while a stream of the bytes makes progress or a promise made to us runs; otherwise
      fetches from the next source (`Fetch`) and wakes again one timeout later.
    - `on_fetch_answer(source, digest, answer, now)`: an accepted fetch is a promise, trusted for
      `PROMISE_TIMEOUTS` timeouts plus the payload's time at `PROMISE_BYTES_PER_S` (not when catching
      up); any answer frees the source for the next fetch queued for it (one in flight per source:
      a catching-up follower wants many payloads, and a peer admits only a few streams from one member).
    - `on_fetch(requester, digest, now)`, as a source: `Serve` what is here; `Promise` what is
      arriving or awaited as a fresh commit, within `MAX_PROMISED_PAYLOADS` and `MAX_PROMISED_ASKERS`;
      `Decline` the rest (a relay catching up itself sends its asker on to a node that has them).
    - `on_arrival(digest, now)`: the bytes are in the store (or the log): `Serve` each promised
      asker and `Release` the waiters.
    - `on_stream(digest, stream, received)`, `on_stream_end(digest, stream, now)`: a stream of the
      bytes is arriving (the daemon; call `on_arrival` first when it completed).
    - `learn_tree(tree)`: a push came down `tree`; its holder's fetch order follows it.
    """

    def __init__(self, node_id: str, store: PayloadStore, timeout_s: float = DEFAULT_RELAY_TIMEOUT_S) -> None:
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise LocalProtocolError(f"relay timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.node_id = node_id
        self.store = store
        self.timeout_s = timeout_s
        self.wants: dict[bytes, _Want] = {}
        self.trees: dict[str, RelayTree] = {}  # holder -> the last tree it pushed to us
        self.promised: dict[bytes, set[str]] = {}  # digest -> askers to serve when its bytes come
        self.incoming: dict[bytes, dict[object, int]] = {}  # digest -> stream -> bytes received so far
        self.in_flight: dict[str, bytes] = {}  # source -> the digest of the fetch awaiting its answer
        self.queued: dict[str, list[bytes]] = {}  # source -> fetches waiting for that source
        self.decisions: deque[tuple[float, str]] = deque(maxlen=MAX_RECENT_DECISIONS)
        self.counts = {"wanted": 0, "fetches": 0, "catch_up_fetches": 0, "promised": 0, "declined": 0,
                       "promises_kept": 0, "promises_ended": 0, "promises_expired": 0, "gave_up": 0}

    def promise_window(self, size: int) -> float:
        """How long an accepted fetch of `size` bytes is trusted before climbing on."""
        return PROMISE_TIMEOUTS * self.timeout_s + size / PROMISE_BYTES_PER_S

    def sources(self, holder: str) -> tuple[str, ...]:
        """Whom to ask, in order: parent, each ancestor, the holder last (in the last tree `holder`
        pushed to us; without one, or not in it, the holder alone)."""
        tree = self.trees.get(holder)
        sources = tree.fetch_sources(self.node_id) if tree is not None and self.node_id in tree.parent else ()
        return sources or (holder,)

    def learn_tree(self, tree: RelayTree) -> None:
        if tree.root != self.node_id:
            self.trees[tree.root] = tree

    # ------------------------------------------------------------ wanting bytes

    def want(self, digest: bytes, holder: str, now: float, *, catching_up: bool, size: int = 0) -> list[FollowerAction]:
        want = self.wants.get(digest)
        if want is not None:
            want.holder, want.last_wanted = holder, now
            want.size = size or want.size
            return []
        if self.store.get(digest) is not None:
            return []
        want = self.wants[digest] = _Want(holder, now, catching_up, size)
        self.counts["wanted"] += 1
        if catching_up:
            self.counts["catch_up_fetches"] += 1
            actions = self._climb(digest, want, now, "committed before it reached us (catching up): fetch at once")
        else:
            self._note(now, digest, f"want, named by {holder}'s append: wait {self.timeout_s:g} s for the push")
            actions = []
        return [*actions, WakeAt(now + self.timeout_s, digest)]

    def on_wake(self, digest: bytes, now: float) -> list[FollowerAction]:
        want = self.wants.get(digest)
        if want is None:
            return []
        if now - want.last_wanted >= GIVE_UP_S:
            return self._give_up(digest, want, now)
        if self.store.get(digest) is not None:
            return self.on_arrival(digest, now)
        streams = self.incoming.get(digest)
        received = sum(streams.values()) if streams else -1
        if streams and received > want.seen:
            want.seen = received
            self._note(now, digest, "wait: a stream of them is arriving (no stall)")
            return [WakeAt(now + self.timeout_s, digest)]
        if now < want.promised_until:
            self._note(now, digest, f"wait: {want.promised_by} accepted our fetch, its promise still runs")
            return [WakeAt(now + self.timeout_s, digest)]
        if want.promised_by:
            self.counts["promises_expired"] += 1
            why = f"{want.promised_by}'s promise ran out without the bytes"
            want.promised_by = ""
        else:
            why = f"no bytes after {want.attempt + 1} relay timeout{'s' if want.attempt else ''}"
        return [*self._climb(digest, want, now, why), WakeAt(now + self.timeout_s, digest)]

    def on_fetch_answer(self, source: str, digest: bytes, answer: FetchAnswer, now: float) -> list[FollowerAction]:
        if self.in_flight.get(source) == digest:
            del self.in_flight[source]
        want = self.wants.get(digest)
        if want is not None and self.store.get(digest) is None:
            if answer is not FetchAnswer.ACCEPTED:
                self._note(now, digest, f"{source} {answer.value} our fetch: climb on at the next wake")
            elif want.catching_up:
                self._note(now, digest, f"{source} accepted our fetch; catching up, so no promise is waited on")
            else:
                want.promised_until = now + self.promise_window(want.size)
                want.promised_by = source
                self._note(now, digest, f"{source} accepted our fetch: trust it for "
                                        f"{self.promise_window(want.size):.2f} s before climbing on")
        return self._next_queued(source, now)

    # ------------------------------------------------------------ as a source

    def on_fetch(self, requester: str, digest: bytes, now: float) -> list[FollowerAction]:
        if self.store.get(digest) is not None:
            return [self._decided(now, Serve(requester, digest, "held here"))]
        want = self.wants.get(digest)
        receiving = bool(self.incoming.get(digest))
        if not receiving and want is None:
            return self._decline(now, requester, digest, "not held here, and not on its way")
        if not receiving and want is not None and want.catching_up:
            return self._decline(now, requester, digest, "catching up on it myself: ask a node that has it")
        askers = self.promised.get(digest)
        if askers is None:
            if len(self.promised) >= MAX_PROMISED_PAYLOADS:
                return self._decline(now, requester, digest, f"promises for {MAX_PROMISED_PAYLOADS} payloads "
                                                             "outstanding already")
            askers = self.promised[digest] = set()
        if requester not in askers and len(askers) >= MAX_PROMISED_ASKERS:
            return self._decline(now, requester, digest, f"promised to {MAX_PROMISED_ASKERS} askers already")
        askers.add(requester)
        self.counts["promised"] += 1
        why = "a stream of them is arriving here" if receiving else f"awaiting them as a fresh commit of {want.holder}"
        return [self._decided(now, Promise(requester, digest, why + ": sent on arrival"))]

    def on_arrival(self, digest: bytes, now: float) -> list[FollowerAction]:
        actions: list[FollowerAction] = []
        askers = self.promised.pop(digest, ())
        if askers and self.store.get(digest) is not None:
            self.counts["promises_kept"] += len(askers)
            actions += [self._decided(now, Serve(asker, digest, "promised, and the bytes arrived"))
                        for asker in sorted(askers)]
        elif askers:
            self._end_promises(now, digest, askers, "the bytes did not stay")
        if self.wants.pop(digest, None) is not None:
            actions.append(self._decided(now, Release(digest, "the bytes are here")))
        return actions

    def on_stream(self, digest: bytes, stream: object, received: int) -> None:
        self.incoming.setdefault(digest, {})[stream] = received

    def on_stream_end(self, digest: bytes, stream: object, now: float) -> None:
        streams = self.incoming.get(digest)
        if streams is None:
            return
        streams.pop(stream, None)
        if streams:
            return
        del self.incoming[digest]
        want = self.wants.get(digest)
        if digest in self.promised and (want is None or want.catching_up) and self.store.get(digest) is None:
            # The promise stood on this stream alone; its askers climb on when their window ends.
            self._end_promises(now, digest, self.promised.pop(digest), "the stream that backed them broke off")

    def forget(self) -> None:
        """A restart: everything here is volatile (the holder resends; stored bytes are the host's)."""
        for volatile in (self.wants, self.trees, self.promised, self.incoming, self.in_flight, self.queued):
            volatile.clear()

    # ------------------------------------------------------------ what it decided, and its bounds

    def recent(self, now: float) -> list[str]:
        """The latest decisions with their reasons, newest first (for /status)."""
        return [f"{max(0.0, now - at):.1f}s ago: {text}" for at, text in reversed(self.decisions)]

    def bound_violations(self, now: float) -> list[str]:
        """What the simulation checks after every relay event: each table within its bound."""
        problems = []
        if len(self.promised) > MAX_PROMISED_PAYLOADS:
            problems.append(f"{len(self.promised)} payloads promised, bound {MAX_PROMISED_PAYLOADS}")
        problems += [f"{short(d)} promised to {len(a)} askers, bound {MAX_PROMISED_ASKERS}"
                     for d, a in self.promised.items() if len(a) > MAX_PROMISED_ASKERS]
        problems += [f"{short(d)} promised while neither awaited as a fresh commit nor arriving"
                     for d in self.promised
                     if not self.incoming.get(d) and (d not in self.wants or self.wants[d].catching_up)]
        problems += [f"{short(d)} still wanted {now - w.last_wanted:.1f}s after its last want (give-up {GIVE_UP_S}s)"
                     for d, w in self.wants.items() if now - w.last_wanted > GIVE_UP_S + 2 * self.timeout_s]
        problems += [f"a fetch from {source} queued while none is in flight" for source in self.queued
                     if self.queued[source] and source not in self.in_flight]
        return problems

    # ------------------------------------------------------------ helpers

    def _climb(self, digest: bytes, want: _Want, now: float, why: str) -> list[FollowerAction]:
        sources = self.sources(want.holder)
        position = min(want.attempt, len(sources) - 1)
        source = sources[position]
        want.attempt += 1
        place = ("the holder" if source == want.holder
                 else "parent" if position == 0 else f"ancestor {position + 1} of {len(sources)}")
        return self._fetch(source, digest, now, f"{why}: ask {source} ({place} in {want.holder}'s tree)")

    def _fetch(self, source: str, digest: bytes, now: float, reason: str) -> list[FollowerAction]:
        if self.in_flight.get(source) == digest or digest in self.queued.get(source, ()):
            self._note(now, digest, f"{reason}; a fetch from {source} is already under way")
            return []
        if source in self.in_flight:
            self.queued.setdefault(source, []).append(digest)
            self._note(now, digest, f"{reason}; queued behind the fetch in flight to {source}")
            return []
        self.in_flight[source] = digest
        self.counts["fetches"] += 1
        return [self._decided(now, Fetch(source, digest, reason))]

    def _next_queued(self, source: str, now: float) -> list[FollowerAction]:
        queue = self.queued.get(source, [])
        actions: list[FollowerAction] = []
        while queue and source not in self.in_flight:
            digest = queue.pop(0)
            if digest in self.wants and self.store.get(digest) is None:
                self.in_flight[source] = digest
                self.counts["fetches"] += 1
                actions.append(self._decided(now, Fetch(source, digest, f"queued: {source} answered the fetch before")))
        if not queue:
            self.queued.pop(source, None)
        return actions

    def _give_up(self, digest: bytes, want: _Want, now: float) -> list[FollowerAction]:
        del self.wants[digest]
        self.counts["gave_up"] += 1
        if digest in self.promised and not self.incoming.get(digest):
            self._end_promises(now, digest, self.promised.pop(digest), "their want was given up")
        return [self._decided(now, Release(digest, f"no append of {want.holder} named them for {GIVE_UP_S:g} s: "
                                                    "given up"))]

    def _end_promises(self, now: float, digest: bytes, askers: Iterable[str], why: str) -> None:
        askers = sorted(askers)
        self.counts["promises_ended"] += len(askers)
        self._note(now, digest, f"promises to {', '.join(askers)} ended: {why}")

    def _decline(self, now: float, requester: str, digest: bytes, why: str) -> list[FollowerAction]:
        self.counts["declined"] += 1
        return [self._decided(now, Decline(requester, digest, why))]

    def _decided(self, now: float, action: Fetch | Serve | Promise | Decline | Release) -> Any:
        verb = type(action).__name__.lower()
        target = f" {'from' if isinstance(action, Fetch) else 'to'} {action.to}" if hasattr(action, "to") else ""
        self.decisions.append((now, f"{verb} {short(action.digest)}{target}: {action.reason}"))
        return action

    def _note(self, now: float, digest: bytes, text: str) -> None:
        line = f"{short(digest)}: {text}"
        if self.decisions and self.decisions[-1][1] == line:
            self.decisions.pop()  # the same wait again: keep one line, with its latest time
        self.decisions.append((now, line))


# ---------------------------------------------------------------- the relay as a whole


@dataclass(slots=True)
class _Waiting:
    metadata: Metadata


@dataclass(slots=True)
class PayloadRelay:
    """A node's relay state: what it has pushed, which appends wait for bytes, when it last answered partly."""

    node_id: str
    store: PayloadStore
    timeout_s: float = DEFAULT_RELAY_TIMEOUT_S
    partial_every_s: float = DEFAULT_PARTIAL_EVERY_S
    verify: bool = True  # False only in the simulation's deliberately broken variant
    # Digests this node sent into a tree as holder, oldest first, at most MAX_PUSHED_DIGESTS.
    pushed: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    waiting: dict[int, _Waiting] = field(default_factory=dict)
    last_partial: dict[str, tuple[float, int]] = field(default_factory=dict)  # holder -> (time, end index)
    next_wait_id: int = 0
    refused: int = 0  # payloads dropped because their bytes did not match the digest
    follower: RelayFollower = field(init=False)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "partial_every_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise LocalProtocolError(f"relay {name} must be > 0 seconds, got {value!r}")
        self.follower = RelayFollower(self.node_id, self.store, self.timeout_s)

    # ------------------------------------------------------------ as lease holder

    def outgoing(self, message: AppendEntries, tree: RelayTree,
                 digest_of: Callable[[LogEntry], bytes] | None = None) -> tuple[Metadata, list[SendPayload]]:
        """An append about to leave the holder: its bytes kept, new ones pushed to the tree's first level.

        `digest_of`: the host's digest of an entry's payload (computed once, reading it a piece at
        a time); the payload is then kept and pushed as the entry holds it (bytes, or the host's
        reference to them). Without it, the bytes are read and hashed here.
        """
        if tree.root != self.node_id:
            raise LocalProtocolError(f"{self.node_id} sends appends down a tree rooted at {tree.root}")
        actions: list[SendPayload] = []
        for entry in message.entries:
            if not entry.payload_size:
                continue
            if digest_of is None:
                payload: Any = entry.payload_bytes()  # read from the log file when it is stored there
                digest = payload_digest(payload)
            else:
                payload, digest = entry.payload, digest_of(entry)
            self.store.put(digest, payload)
            if digest not in self.pushed:
                self.mark_pushed(digest)
                actions += [SendPayload(child, PayloadHop(digest, payload, tree))
                            for child in tree.children.get(self.node_id, ())]
        return Metadata(message, tree), actions

    def mark_pushed(self, digest: bytes) -> None:
        """Remember that `digest` went down a tree (forgetting the oldest past MAX_PUSHED_DIGESTS)."""
        self.pushed[digest] = None
        self.pushed.move_to_end(digest)
        while len(self.pushed) > MAX_PUSHED_DIGESTS:
            self.pushed.popitem(last=False)

    # ------------------------------------------------------------ as follower (the simulation)

    def on_metadata(self, metadata: Metadata, now: float) -> list[RelayAction]:
        """An append by digest: delivered whole if every payload is here; otherwise the part we can
        take now (paced), the rest held, and each missing payload wanted from the follower."""
        assembled, complete = self._assemble(metadata)
        if complete:
            return [Deliver(assembled)]
        actions: list[RelayAction] = []
        message = metadata.message
        last_at, last_end = self.last_partial.get(message.leader_id, (float("-inf"), -1))
        end = assembled.prev_index + len(assembled.entries)
        if end > last_end or now - last_at >= self.partial_every_s:
            self.last_partial[message.leader_id] = (now, end)
            actions.append(Deliver(assembled))  # what we hold now, at least the heartbeat
        if len(self.waiting) >= MAX_WAITING_MESSAGES:
            self.waiting.pop(min(self.waiting))
        self.next_wait_id += 1
        self.waiting[self.next_wait_id] = _Waiting(metadata)
        for entry in message.entries:
            if entry.payload_size:
                digest = payload_digest(entry.payload_bytes())
                if self.store.get(digest) is None:
                    actions += self.follower.want(digest, message.leader_id, now, size=entry.payload_size,
                                                  catching_up=entry.index <= message.leader_commit)
        return actions

    def on_wake(self, digest: bytes, now: float) -> list[RelayAction]:
        return list(self.follower.on_wake(digest, now))

    def on_request(self, request: PayloadRequest, now: float) -> list[RelayAction]:
        return list(self.follower.on_fetch(request.requester, request.digest, now))

    def on_fetch_answer(self, source: str, digest: bytes, answer: FetchAnswer, now: float) -> list[RelayAction]:
        return list(self.follower.on_fetch_answer(source, digest, answer, now))

    def on_payload(self, hop: PayloadHop, now: float) -> list[RelayAction]:
        if self.verify and payload_digest(hop.payload) != hop.digest:
            self.refused += 1  # altered on the way: dropped, and fetched again from higher up
            return []
        return self.on_verified(hop, now)

    def on_verified(self, hop: PayloadHop, now: float) -> list[RelayAction]:
        """Bytes the host already checked against `hop.digest` (hashed while they streamed in):
        kept, passed on down their tree if new, promised askers served, waiting appends delivered."""
        new = self.store.get(hop.digest) is None
        self.store.put(hop.digest, hop.payload)
        actions: list[RelayAction] = []
        if hop.tree is not None:
            self.follower.learn_tree(hop.tree)
            if new:
                actions += [SendPayload(child, hop) for child in hop.tree.children.get(self.node_id, ())]
        actions += self.follower.on_arrival(hop.digest, now)
        for wait_id in sorted(self.waiting):
            assembled, complete = self._assemble(self.waiting[wait_id].metadata)
            if complete:
                del self.waiting[wait_id]
                actions.append(Deliver(assembled))
        return actions

    def forget_waiting(self) -> None:
        """A restart: held-back appends and the follower's state are volatile (the holder resends);
        stored bytes are not."""
        self.waiting.clear()
        self.last_partial.clear()
        self.follower.forget()

    # ------------------------------------------------------------ helpers

    def _assemble(self, metadata: Metadata) -> tuple[AppendEntries, bool]:
        """The holder's append cut before the first entry whose bytes we lack, and whether nothing was cut.

        Any prefix is an append the holder could have sent itself (a follower commits at most
        through the last entry it was given), so delivering it early is safe.
        """
        entries = []
        for entry in metadata.message.entries:
            if entry.payload_size:
                held = self.store.get(payload_digest(entry.payload_bytes()))
                if held is None:
                    return replace(metadata.message, entries=tuple(entries)), False
                entry = replace(entry, payload=held)
            entries.append(entry)
        return replace(metadata.message, entries=tuple(entries)), True


def sends_of(actions: Iterable[RelayAction]) -> int:
    """How many payload copies these actions send (what a holder's uplink carries)."""
    return sum(1 for action in actions if isinstance(action, SendPayload))
