"""Test-wide setup that must happen before JAX initialises.

Forces two host CPU devices (tests of data-parallel learners need several devices) and keeps
XLA from oversubscribing this machine's two cores when several JAX users run at once.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
