"""A local cluster of real `diloco-node run` sites on 127.0.0.1, and what they report.

Integration tests, the demo and the daemon benchmarks add sites to a `Cluster` (each launched by
`testbed.launcher`: free port, its own data directory and log under the cluster's root, one run
secret for all) and watch them through `/status`: `poll` records every (commit index, state
digest) pair any site reports, so a test can ask whether two sites ever disagreed. `Cluster` is a
context manager; `close()` SIGKILLs and reaps every process it started, links included, whatever
state the caller left them in. `Cluster.create(root, tls=True)` makes a run CA under `root/pki`
and gives every site its own certificate: the sites then speak to each other over mutual TLS.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from diloco_node.ops import pki
from diloco_node.testbed.launcher import (
    DEFAULT_SETTINGS,
    ChildProcess,
    LinkShape,
    Site,
    SiteSpec,
    launch_site,
    start_link,
    write_secret,
)


@dataclass
class Cluster:
    root: Path
    secret_file: Path
    sites: dict[str, Site] = field(default_factory=dict)
    # Every (commit_index -> state_digest) any site ever reported: one digest per index, ever.
    history: dict[int, set[str]] = field(default_factory=dict)  # commit index -> digests reported there
    reporters: dict[int, set[str]] = field(default_factory=dict)  # commit index -> sites that reported it
    extra_links: list[ChildProcess] = field(default_factory=list)  # started by `link_to`
    tls: bool = False  # sites get certificates from the run CA in root/pki/ca

    @classmethod
    def create(cls, root: Path, *, tls: bool = False) -> Cluster:
        root.mkdir(parents=True, exist_ok=True)
        if tls:
            pki.init_ca(root / "pki" / "ca")
        return cls(root, write_secret(root / "secret"), tls=tls)

    @property
    def ca_dir(self) -> Path:
        return self.root / "pki" / "ca"

    def site_tls_dir(self, node_id: str) -> Path:
        """The site's certificate directory, issued by the run CA on first use."""
        out = self.root / "pki" / node_id
        if not (out / pki.SITE_CERT).exists():
            pki.issue_site(self.ca_dir, node_id, out, hosts=("127.0.0.1",))
        return out

    def spec(self, node_id: str, *, bootstrap: Site | str | None = None, settings: Sequence[str] = DEFAULT_SETTINGS,
             secret_file: Path | None = None, env: Mapping[str, str] | None = None, role: str | None = None,
             link: LinkShape | None = None, extra: Sequence[str] = ()) -> SiteSpec:
        """The spec of a site of this cluster: data under `root/node_id`, log `root/node_id.log`;
        `bootstrap` is a site (its peer address) or HOST:PORT."""
        peer = bootstrap.address if isinstance(bootstrap, Site) else bootstrap
        return SiteSpec(node_id, self.root / node_id, self.root / f"{node_id}.log", secret_file or self.secret_file,
                        settings=tuple(settings), role=role, bootstrap=peer, link=link, extra_args=tuple(extra),
                        env=dict(env or {}), tls_dir=self.site_tls_dir(node_id) if self.tls else None)

    def add(self, node_id: str, *, bootstrap: Site | str | None = None, settings: Sequence[str] = DEFAULT_SETTINGS,
            secret_file: Path | None = None, env: Mapping[str, str] | None = None, role: str | None = None,
            link: LinkShape | None = None, extra: Sequence[str] = (), start: bool = True) -> Site:
        """A site of this cluster (see `spec`), started unless `start` is False."""
        spec = self.spec(node_id, bootstrap=bootstrap, settings=settings, secret_file=secret_file, env=env,
                         role=role, link=link, extra=extra)
        site = launch_site(spec) if start else Site(spec)
        self.sites[node_id] = site
        return site

    def link_to(self, node_id: str, shape: LinkShape) -> str:
        """One more emulated link in front of a running site (a joiner's view of it, say); its
        HOST:PORT. Closed with the cluster."""
        link = start_link(shape, self.sites[node_id].spec.port, self.root / f"link-{shape.port}-{node_id}.log")
        self.extra_links.append(link)
        return f"127.0.0.1:{shape.port}"

    def remove(self, node_id: str) -> None:
        """Kill a site and forget it (a site that was meant to fail, say)."""
        self.sites.pop(node_id).close()

    def close(self) -> None:
        # Every site is closed even if one cannot be reaped; the first such error is raised after.
        with contextlib.ExitStack() as stack:
            for site in self.sites.values():
                stack.callback(site.close)
            for link in self.extra_links:
                stack.callback(link.kill)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- observation ----------------------------------------------------------------------

    def poll(self) -> dict[str, dict[str, Any]]:
        """Current status of every running site; records (index, digest) pairs in `history`."""
        out = {}
        for node_id, site in self.sites.items():
            if not site.running:
                continue
            doc = site.status()
            if doc is None:
                continue
            out[node_id] = doc
            if doc.get("ready"):
                self.history.setdefault(doc["commit_index"], set()).add(doc["state_digest"])
                self.reporters.setdefault(doc["commit_index"], set()).add(node_id)
        return out

    def start_voters(self, names: Sequence[str], *, settings: Sequence[str], timeout: float) -> dict[str, dict[str, Any]]:
        """The first of `names` founds the run and the others join it; returns the statuses once
        every one is ready and sees all of them as voters."""
        founder = self.add(names[0], settings=settings)
        self.wait_for(f"{names[0]} ready", lambda s: s.get(names[0], {}).get("ready", False), timeout)
        for name in names[1:]:
            self.add(name, bootstrap=founder, settings=settings)
        return self.wait_for(f"{len(names)} ready voters", lambda s: set(names) <= {
            n for n, d in s.items() if d.get("ready")} and all(
            {m["node_id"] for m in s[n]["members"] if m["voter"]} == set(names) for n in names), timeout)

    def wait_for(self, what: str, check: Callable[[dict[str, dict[str, Any]]], bool], timeout: float,
                 interval: float = 0.3) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        last: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            last = self.poll()
            if check(last):
                return last
            time.sleep(interval)
        brief = {n: (d.get("ready"), d.get("coordinator"), d.get("commit_index"), d.get("ready_reason"))
                 for n, d in last.items()}
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last statuses: {brief}")

    def common_commit_index(self, names: set[str], timeout: float) -> int:
        """Poll until one commit index has been reported (ready) by every site in `names`; the
        highest such index. Digests at it are recorded in `history` as for every poll."""
        seen: dict[str, set[int]] = {n: set() for n in names}

        def check(statuses: dict[str, dict[str, Any]]) -> bool:
            for n in names:
                if n in statuses and statuses[n].get("ready"):
                    seen[n].add(statuses[n]["commit_index"])
            return bool(set.intersection(*seen.values()))

        self.wait_for(f"one commit index reported by all of {sorted(names)}", check, timeout, interval=0.05)
        return max(set.intersection(*seen.values()))

    def conflicting_indices(self) -> dict[int, set[str]]:
        return {index: digests for index, digests in self.history.items() if len(digests) > 1}

    def shared_indices(self) -> int:
        """How many commit indices at least two sites reported: what the digest check compared."""
        return sum(1 for nodes in self.reporters.values() if len(nodes) > 1)

    def coordinator(self, statuses: dict[str, dict[str, Any]]) -> str | None:
        holders = {d.get("coordinator") for d in statuses.values() if d.get("coordinator")}
        return holders.pop() if len(holders) == 1 else None
