"""Run a shell command in a private mount namespace, as tests of real bind mounts need."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_in_private_mount_namespace(cmd: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``sh -c cmd`` under ``unshare --mount --propagation private``, with this interpreter's imports.

    Skips the calling test where the machine allows no mount namespaces; the caller checks the rest.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no mount namespaces here: {proc.stderr.strip()}")
    return proc
