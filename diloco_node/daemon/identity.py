"""Who this site is in its run: found, join or restart; the run manifest; the members' addresses.

A data directory belongs to one node of one run (`identity.json` in the coordination store): a
restart reads it back and checks the configuration against it; a founder writes it; a joiner
negotiates the run's manifest and membership through a bootstrap peer first (join.py). Addresses
learned from peers are kept here and persisted with the identity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import Executor
from typing import Literal

from bootstrap import messages as coord
from bootstrap.coordinator_node import PersistentState
from diloco_node.clock import Clock
from diloco_node.config.manifest import RunManifest
from diloco_node.learn import data as data_lib
from diloco_node.learn import factory
from diloco_node.config.settings import ConfigError, EffectiveConfig, check_joiner_manifest
from diloco_node.daemon import peers
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.join import JoinRefused, negotiate
from diloco_node.sync.evictions import EVICTED_MARK
from diloco_node.transport import PeerClient, PeerRefused, TransportError
from wire import messages as wire

log = logging.getLogger("diloco_node.daemon")

# A member announcement (JoinRequest) to one peer gives up after this; the next refresh retries.
ANNOUNCE_DEADLINE_S = 5.0

StartMode = Literal["found", "join", "restart"]


class SiteIdentity:
    """`executor` (the set-up pool) seals a founder's manifest and checks a run's model before a
    join; `clock` stamps the founding time and paces the join's retries."""

    def __init__(self, effective: EffectiveConfig, store: CoordinationStore, client: PeerClient,
                 role: coord.MemberRole, *, clock: Clock, executor: Executor) -> None:
        self.effective = effective
        self.clock = clock
        self.executor = executor
        self.node_id = effective.node.node_id
        self.store = store
        self.client = client
        self.role = role
        self.addresses = peers.AddressBook({self.node_id: effective.node.advertise})
        self.addresses.learn(self.node_id, effective.node.advertise, effective.node.role)
        self.addresses.learn_status_url(self.node_id, effective.node.status_url)
        self.manifest: RunManifest | None = None
        self.bootstrap_url: str | None = None  # the peer a joiner joined through

    async def establish(self) -> tuple[StartMode, PersistentState, RunManifest]:
        """Restart from our data directory, found a run, or join one; returns the durable state and
        the run's manifest (also kept as `manifest`)."""
        cfg = self.effective.node
        if self.store.exists():
            identity = self.store.load_identity()
            if identity.get("node_id") != self.node_id:
                raise ConfigError(f"data_dir {cfg.data_dir} belongs to node {identity.get('node_id')!r}, "
                                  f"not {self.node_id!r}")
            self.manifest = RunManifest.from_dict(identity["manifest"])
            check_joiner_manifest(self.effective.run, self.manifest, self.effective.explicit_run_keys())
            for node_id, url in identity.get("addresses", {}).items():
                self.addresses.learn(node_id, url)
            return "restart", self.store.load_persistent(), self.manifest
        loop = asyncio.get_running_loop()
        if cfg.is_founder:
            # The founder publishes its model's parameter signature and its tokenizer's digest:
            # every later site is checked against them (off the loop: the factory may import a
            # user's module, and the tokenizer file is hashed).
            sealed = await loop.run_in_executor(self.executor, self._seal, self.effective.run)
            self.manifest = dataclasses.replace(sealed, founded_at=self.clock.wall())  # [run.stop] wall_s counts from here
            self.save()
            return "found", PersistentState.founding([self.node_id]), self.manifest
        urls = [peer.url(cfg.peer_scheme) for peer in cfg.bootstrap]  # https with TLS
        async def check_model(theirs: RunManifest) -> None:
            await loop.run_in_executor(self.executor, self._check_before_admission, theirs)

        manifest, membership, via = await negotiate(self.client, urls, self.effective, self.node_id,
                                                    cfg.advertise, peers.role_to_wire(self.role), check_model,
                                                    clock=self.clock, status_url=cfg.status_url)
        self.manifest = manifest
        self.learn_members(membership)
        self.bootstrap_url = via
        self.save()
        return "join", PersistentState.joining(), manifest

    def _seal(self, manifest: RunManifest) -> RunManifest:
        sealed = factory.seal(manifest)
        if self.role is coord.MemberRole.LEARNER:
            try:
                sealed = data_lib.seal_tokenizer(sealed, self.effective.node.data)
            except data_lib.DataError as error:
                raise ConfigError(str(error)) from None
        return sealed

    def _check_before_admission(self, theirs: RunManifest) -> None:
        """A joiner's model and (on a learner) its tokenizer against the run's, before it is admitted:
        a site that would be refused later changes nothing anywhere."""
        factory.check_signature(theirs)
        if self.role is coord.MemberRole.LEARNER:
            try:
                data_lib.check_tokenizer(theirs.data.tokenizer_sha256, self.effective.node.data)
            except data_lib.DataError as error:
                raise ConfigError(str(error)) from None

    def has_peers(self) -> bool:
        return bool(self.effective.node.bootstrap) or any(n != self.node_id for n, _ in self.addresses.items())

    def save(self) -> None:
        assert self.manifest is not None
        self.store.save_identity({"node_id": self.node_id, "role": self.effective.node.role,
                                  "manifest": self.manifest.to_dict(), "addresses": self.addresses.to_dict()})

    def remember(self, node_id: str, url: str, role: str | None = None) -> None:
        if self.addresses.learn(node_id, url, role) and self.manifest is not None:
            self._save_addresses()

    def _save_addresses(self) -> None:
        """The address book persisted; a disk that refuses it (failing `identity.write` on /status)
        costs nothing now: the addresses stay in memory and are written with the next change."""
        try:
            self.save()
        except OSError as error:
            log.warning("%s: the address book is not persisted (%s); kept in memory", self.node_id, error)

    def learn_members(self, membership: wire.Membership) -> None:
        changed = False
        for member in membership.members:
            changed |= self.addresses.learn(member.node_id, member.advertise_url, member.role.value)
            if member.node_id != self.node_id:  # our own is what our config says
                self.addresses.learn_status_url(member.node_id, member.status_url)
        if changed and self.manifest is not None:
            self._save_addresses()

    async def announce(self) -> None:
        """Tell every member we know that we are here (joiners, and restarts after a leave)."""
        assert self.manifest is not None
        request = wire.JoinRequest(self.node_id, self.effective.node.advertise, peers.role_to_wire(self.role),
                                   self.manifest.digest_bytes(), status_url=self.effective.node.status_url)

        async def one(url: str) -> None:
            try:
                for reply in await self.client.send(url, request, deadline_s=ANNOUNCE_DEADLINE_S):
                    if isinstance(reply, wire.Membership):
                        self.learn_members(reply)
            except TransportError as error:
                if isinstance(error, PeerRefused) and error.status == 403 and EVICTED_MARK in error.reason:
                    raise JoinRefused(error.reason, permanent=True) from None  # exit 3: a restart cannot help
                log.info("announce to %s failed: %s", url, error)

        await asyncio.gather(*(one(url) for node_id, url in self.addresses.items() if node_id != self.node_id))

    async def refresh_members(self, voters: frozenset[str] | set[str]) -> None:
        """Learn addresses of members we only know by id (from configuration entries)."""
        if any(self.addresses.url(v) is None for v in voters):
            await self.announce()
