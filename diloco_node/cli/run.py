"""`diloco-node run`: start this site's daemon (found a run, or join one with --bootstrap).

Exit statuses (diloco_node/daemon/exits.py): 0 clean stop (SIGTERM/SIGINT, or the run is complete),
1 transient failure (a crash, or no bootstrap peer answered within the join deadline: a restart
helps), 2 configuration error, 3 the run refused us (wrong secret, contradicting manifest) and 4 a
file of the node's state unreadable or unwritable at start (one line naming it): all permanent, so
the systemd unit does not restart on them (RestartPreventExitStatus=2 3 4).
On a multi-host site, 1 is also a lost host (process 0 or a follower whose learner's collective
failed), and a host may end by SIGABRT instead: JAX aborts every process of a site whose process 0
died or whose host missed its heartbeats ([node.cluster] heartbeat_timeout_s); systemd's
Restart=on-failure restarts both.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from diloco_node.config.settings import ConfigError, add_run_flags, load_config_from_args
from diloco_node.daemon.exits import EXIT_CONFIG
from diloco_node.ops.logs import LOG_FORMATS, configure_logging
from diloco_node.storage import failpoints


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    add_run_flags(parser)
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="auto",
                        help="auto (default): journald priorities and no timestamp under systemd, text "
                             "elsewhere; json: one object per line (ts, level, logger, msg, node)")


def _event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:  # the stdlib loop works too, only slower
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _use_persistent_compilation_cache(data_dir: str) -> None:
    """Compiled XLA programs are kept in `<data_dir>/jax-cache` so a restart (or a second site on
    the same host pointed at a shared cache) skips most of the model's compile time.

    An operator's own JAX_COMPILATION_CACHE_DIR (e.g. one cache shared by several sites) wins. JAX
    reads these variables when it is imported, so this runs before the import.
    """
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(data_dir, "jax-cache"))
    # The model's initialisation is many small programs, each under JAX's default 1 s threshold;
    # caching them too is what makes a warm start fast (measured: 5.6 s -> 0.8 s for the tiny model).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _check_state_files(data_dir: str) -> int | None:
    """The node's own files read before JAX is imported (daemon/start_check.py): an exit status
    and its one line when they cannot be, else None."""
    from diloco_node.daemon.exits import EXIT_STORAGE, START_STORAGE_ERRORS, start_error_line
    from diloco_node.daemon.start_check import check_state_files

    try:
        check_state_files(data_dir)
    except ConfigError as error:  # a damaged record the start refuses (quarantined, named)
        code, line = EXIT_CONFIG, str(error)
    except START_STORAGE_ERRORS as error:
        code, line = EXIT_STORAGE, start_error_line(error)
    else:
        return None
    logging.getLogger("diloco_node.daemon").error("%s", line)
    print(f"diloco-node run: {line}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        effective = load_config_from_args(args)
        cluster = effective.node.cluster
        if not (cluster.enabled and cluster.process_id > 0):  # a follower host talks to no peer
            effective.read_secret()  # fail in milliseconds, before JAX is imported
    except ConfigError as error:
        print(f"diloco-node run: {error}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        armed_failpoints = failpoints.load_from_env()  # tests and chaos runs only (docs/DAEMON.md)
    except failpoints.FailpointError as error:
        print(f"diloco-node run: {failpoints.ENV_VAR}: {error}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(effective.node.log_level, effective.node.node_id, getattr(args, "log_format", "auto"),
                      stream=sys.stderr)
    for warning in effective.warnings:
        logging.getLogger("diloco_node.daemon").warning("%s", warning)
    if armed_failpoints:
        logging.getLogger("diloco_node.daemon").warning("failpoints armed (a test or chaos run): %s", armed_failpoints)
    if not (cluster.enabled and cluster.process_id > 0):  # a follower host keeps no coordination state
        code = _check_state_files(effective.node.data_dir)
        if code is not None:
            return code
    _use_persistent_compilation_cache(effective.node.data_dir)
    from diloco_node.ops.allocator import return_large_frees_to_os  # before the state is allocated

    logging.getLogger("diloco_node.daemon").info("%s", return_large_frees_to_os())
    if cluster.enabled:
        from diloco_node.learn import cluster as cluster_lib  # imports JAX

        cluster_lib.initialize(cluster)  # before anything touches JAX's devices
        if cluster_lib.is_follower():
            from diloco_node.daemon.site_follower import run_follower

            return _leave_cluster(run_follower(effective))
    from diloco_node.daemon.node import Node  # imports JAX: only for `run`

    node = Node(effective, environ=dict(os.environ))
    _event_loop_policy()
    code = asyncio.run(node.run())
    if code != 0 and node.exit_reason:
        print(f"diloco-node run: {node.exit_reason}", file=sys.stderr)
    return _leave_cluster(code) if cluster.enabled else code


def _leave_cluster(code: int) -> int:
    """A failed host of a multi-host site exits now. JAX's exit hook would first wait at a
    shutdown barrier for every process, which a lost host never reaches: the wait ends only at
    the heartbeat timeout, in an abort. A clean stop goes through the barrier (every host meets it)."""
    if code == 0:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
