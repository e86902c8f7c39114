"""The exit statuses of `diloco-node run`, and which of them a restart cannot fix.

systemd restarts a failed unit (`Restart=on-failure`); a restart helps a crash, a lost device or a
run that did not answer in time, and never a bad setting or a run that refused us: those exit with
a status listed in the unit's `RestartPreventExitStatus=` (examples/systemd/diloco-node.service),
so the operator reads one clear error instead of a restart every few seconds forever.
"""

from __future__ import annotations

from diloco_node.config.settings import ConfigError
from diloco_node.daemon.join import JoinRefused

EXIT_OK = 0  # a clean stop (SIGTERM/SIGINT) or the run reached its [run.stop]
EXIT_FAILED = 1  # transient: a runtime failure, or no bootstrap peer answered before the join deadline
EXIT_CONFIG = 2  # permanent: bad configuration, unreadable or unsafe secret or TLS files
EXIT_REFUSED = 3  # permanent: the run refused us (wrong secret, contradicting manifest or model)

# What a restart cannot change: the unit's RestartPreventExitStatus= lists exactly these.
PERMANENT = frozenset({EXIT_CONFIG, EXIT_REFUSED})


def exit_status_for(error: JoinRefused | ConfigError) -> int:
    """A refusal a restart cannot change exits with a permanent status; a join that ran out of
    time, or a state download that failed, with a transient one."""
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    return EXIT_REFUSED if error.permanent else EXIT_FAILED
