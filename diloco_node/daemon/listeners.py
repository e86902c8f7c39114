"""The node's HTTP listeners: the peer port (and the operator port when `status_listen` is set), TLS reloads.

One aiohttp application carries the peer routes (/v1/<kind>, transport/) and, unless the operator
routes have a listener of their own, /, /status, /metrics, /livez, /readyz, /evict, /profile and
/accept-loss (ops/status.py). Each listener has a connection guard (idle connections closed). With TLS the
certificates reload without a restart: on SIGHUP at once, and when the files change (checked every
`tls_reload_check_s`). The application's cleanup closes the node's services, in the order
`Services.closers` gives. Routes that need the site's parts go through the node's `StartingGate`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from aiohttp import web

from diloco_node.clock import process_age_s
from diloco_node.daemon.gate import StartingGate
from diloco_node.daemon.lost_entries import accept_loss
from diloco_node.daemon.plan import DaemonPlan
from diloco_node.daemon.services import Services
from diloco_node.daemon.tasks import closed_on_cleanup
from diloco_node.ops.debug_routes import debug_routes
from diloco_node.ops.profiling import ProfileCapture
from diloco_node.ops.status import operator_routes
from diloco_node.transport import ConnectionGuard
from diloco_node.transport.tls import SiteTls
from wire.errors import RemoteProtocolError

log = logging.getLogger("diloco_node.daemon")


class Listeners:
    def __init__(self, services: Services, plan: DaemonPlan, gate: StartingGate[Any]) -> None:
        self.services = services
        self.plan = plan
        self.gate = gate
        cfg = services.cfg
        self.node_id = services.node_id
        app = self.app = web.Application(client_max_size=plan.http_body_max_bytes)
        self.guard = ConnectionGuard()
        self.guard.install(app)
        services.server.install(app)
        # None: the operator routes share the peer port.
        self.operator_app = app if cfg.operator_listen is None else web.Application(
            client_max_size=plan.http_body_max_bytes)
        self.operator_app.add_routes(operator_routes(
            services.status_document, services.metrics, services.live, services.samples, evict=self._evict,
            profile=ProfileCapture(cfg.data_dir).capture, accept_loss=self._accept_loss))
        self.operator_app.add_routes(debug_routes(os.environ))  # tests and chaos runs only (empty otherwise)
        # Resources live as long as the app; cleanup runs in reverse order of set-up.
        app.cleanup_ctx.append(closed_on_cleanup(*services.closers()))
        app.cleanup_ctx.append(services.client.cleanup_ctx)  # the peer session
        self.runner = web.AppRunner(app, access_log=None)
        self.operator_runner = None if cfg.operator_listen is None else web.AppRunner(self.operator_app,
                                                                                       access_log=None)

    async def setup(self) -> None:
        """Start the application (its resources' lives begin here; `close` ends them)."""
        await self.runner.setup()
        assert self.runner.server is not None
        self.services.tasks.spawn(self.guard.run(self.runner.server), name="connection-guard")

    async def listen(self) -> None:
        """Open the operator listener (if any), then the peer port (OSError naming which failed)."""
        services, cfg = self.services, self.services.cfg
        if self.operator_runner is not None:
            await self._start_operator_listener(self.operator_runner, self.operator_app)
        tls = services.credentials.tls
        if tls is not None:
            self._show_tls(tls)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_tls, tls, "SIGHUP")
            services.tasks.spawn(self._watch_tls(tls), name="tls-reload")
        site = web.TCPSite(self.runner, cfg.listen.host, cfg.listen.port,
                           ssl_context=tls.server_context if tls is not None else None)
        await site.start()
        log.info("%s listening on %s (advertised %s), %.2f s after process start", self.node_id,
                 cfg.listen, cfg.advertise, process_age_s())

    async def close(self) -> None:
        if self.operator_runner is not None:
            await self.operator_runner.cleanup()
        await self.runner.cleanup()

    async def _evict(self, node_id: str, reason: str) -> tuple[int, dict[str, Any]]:
        """`POST /evict`: the lease holder's coordination carries it out; 503 while starting."""
        try:
            parts = self.gate.parts()
        except RemoteProtocolError as error:
            return 503, {"error": str(error)}
        result: tuple[int, dict[str, Any]] = await parts.evict(node_id, reason)
        return result

    async def _accept_loss(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """`POST /accept-loss`: the operator lifts the vote barrier (daemon/lost_entries.py); 503 while starting."""
        try:
            parts = self.gate.parts()
        except RemoteProtocolError as error:
            return 503, {"error": str(error)}
        return accept_loss(parts.coordination, by=body.get("by", ""), reason=body.get("reason", ""),
                           lost_after=body.get("lost_after"))

    async def _start_operator_listener(self, runner: web.AppRunner, app: web.Application) -> None:
        """/status, /metrics, /livez, /readyz and / on their own (plain HTTP, loopback by default)
        listener, as etcd separates its peer and metrics URLs: the peer port speaks TLS only."""
        listen = self.services.cfg.operator_listen
        assert listen is not None
        guard = ConnectionGuard()
        guard.install(app)
        await runner.setup()
        assert runner.server is not None
        self.services.tasks.spawn(guard.run(runner.server), name="operator-connection-guard")
        try:
            await web.TCPSite(runner, listen.host, listen.port).start()
        except OSError as error:  # named, so the log does not blame the peer port
            raise OSError(error.errno, f"status_listen {listen}: {error.strerror}") from None
        log.info("%s: operator routes on http://%s", self.node_id, listen)

    def _reload_tls(self, tls: SiteTls, why: str) -> None:
        self._report_tls_reload(tls, why, tls.reload())

    async def _watch_tls(self, tls: SiteTls) -> None:
        while True:
            await self.services.clock.sleep(self.plan.tls_reload_check_s)
            outcome = tls.reload_if_changed()
            if outcome is not None:
                self._report_tls_reload(tls, "TLS files changed", outcome)

    def _show_tls(self, tls: SiteTls) -> None:
        facts = tls.facts
        self.services.status.set_tls(
            node_id=facts.node_id, fingerprint=facts.fingerprint, not_after_unix=facts.not_after_unix,
            ca_subject=facts.ca_subject, crl_loaded=facts.crl_loaded, loaded_at_unix=tls.loaded_at_unix,
            reloads=tls.reloads, reload_error=tls.last_reload_error)

    def _report_tls_reload(self, tls: SiteTls, why: str, outcome: str) -> None:
        self._show_tls(tls)
        if tls.last_reload_error:
            self.services.report_error(f"{why}: {outcome}")  # shown in /status: the site still runs on the old files
        else:
            log.info("%s: %s: %s", self.node_id, why, outcome)
