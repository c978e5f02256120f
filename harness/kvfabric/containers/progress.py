"""Run a long step and say how it goes.

Its output goes out with a prefix, a heartbeat tells the time spent and roughly how long is left,
estimated from the same step's duration the last time it ran here.

Durations are remembered in ``<cache>/step-times.json`` (one number per step name); the first run of
a step on a machine says only how long it has been running.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from kvfabric.localcluster.versions import cache_root

HEARTBEAT_S = 15.0


def _times_file() -> Path:
    return cache_root() / "step-times.json"


def last_duration(step: str) -> float | None:
    """Seconds the step took the last time it finished successfully here, if it ever did."""
    try:
        value = json.loads(_times_file().read_text()).get(step)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, int | float) else None


def remember_duration(step: str, seconds: float) -> None:
    """Record a successful step's duration (best effort: a read-only cache only loses the estimate)."""
    path = _times_file()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
        data[step] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except (OSError, ValueError):
        pass


def eta_text(elapsed: float, previous: float | None) -> str:
    """``2m05s elapsed, ~1m30s left`` (or ``, first run here`` without a previous duration)."""
    text = f"{_mmss(elapsed)} elapsed"
    if previous is None:
        return text + ", no earlier run to estimate from"
    left = previous - elapsed
    return text + (f", ~{_mmss(left)} left" if left > 0 else ", taking longer than the last run")


def _mmss(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 60}m{s % 60:02d}s"


def run_step(
    step: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdin: IO[bytes] | None = None,
    keep_line: Callable[[str], bool] = lambda _line: True,
    out: IO[str] = sys.stderr,
) -> str:
    """Run ``argv``, streaming the lines ``keep_line`` accepts as ``[step] line``, plus a heartbeat.

    Returns the whole output (for error messages); raises ``subprocess.CalledProcessError`` on failure.
    """
    previous = last_duration(step)
    start = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{step}] {msg}", file=out, flush=True)

    say("starting" + (f" (took {_mmss(previous)} last time)" if previous is not None else ""))
    proc = subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    lines: list[str] = []
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            say(eta_text(time.monotonic() - start, previous))

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            if keep_line(line):
                say(line)
        rc = proc.wait()
    finally:
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        done.set()
        beat.join()
    elapsed = time.monotonic() - start
    output = "\n".join(lines)
    if rc != 0:
        say(f"failed after {_mmss(elapsed)} (exit {rc})")
        raise subprocess.CalledProcessError(rc, list(argv), output)
    remember_duration(step, elapsed)
    say(f"done in {_mmss(elapsed)}")
    return output
