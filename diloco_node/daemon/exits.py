"""The exit statuses of `diloco-node run`, and which of them a restart cannot fix.

systemd restarts a failed unit (`Restart=on-failure`); a restart helps a crash, a lost device or a
run that did not answer in time, and never a bad setting or a run that refused us: those exit with
a status listed in the unit's `RestartPreventExitStatus=` (examples/systemd/diloco-node.service),
so the operator reads one clear error instead of a restart every few seconds forever.
"""

from __future__ import annotations

import errno

from diloco_node.config.settings import ConfigError
from diloco_node.daemon.join import JoinRefused
from diloco_node.daemon.log_records import CoordinationStoreError
from diloco_node.ops.checkpoint import CheckpointError

EXIT_OK = 0  # a clean stop (SIGTERM/SIGINT) or the run reached its [run.stop]
EXIT_FAILED = 1  # transient: a runtime failure, or no bootstrap peer answered before the join deadline
EXIT_CONFIG = 2  # permanent: bad configuration, unreadable or unsafe secret or TLS files
EXIT_REFUSED = 3  # permanent: the run refused us (wrong secret, contradicting manifest or model)
# permanent: a file of the node's own state (coordination, checkpoint, identity, history) could not
# be read or written while starting. A restart reads the same file on the same disk; the operator
# repairs or restores it (the one line names it), then restarts.
EXIT_STORAGE = 4

# What a restart cannot change: the unit's RestartPreventExitStatus= lists exactly these.
PERMANENT = frozenset({EXIT_CONFIG, EXIT_REFUSED, EXIT_STORAGE})

# What reading or writing the node's own files at start raises: each message names the file.
START_STORAGE_ERRORS = (OSError, CoordinationStoreError, CheckpointError)


def exit_status_for(error: JoinRefused | ConfigError) -> int:
    """A refusal a restart cannot change exits with a permanent status; a join that ran out of
    time, or a state download that failed, with a transient one."""
    if isinstance(error, ConfigError):
        return EXIT_CONFIG
    return EXIT_REFUSED if error.permanent else EXIT_FAILED


def start_error_line(error: BaseException) -> str:
    """One line for a file the node could not read or write while starting: the file and the
    error's errno text (an OSError's own str() quotes the path after `[Errno N]`)."""
    if isinstance(error, OSError) and error.filename is not None:
        name = errno.errorcode.get(error.errno or 0, "?")
        return f"cannot start: {error.filename}: {error.strerror} ({name})"
    return f"cannot start: {' '.join(str(error).split())}"
