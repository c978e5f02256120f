"""Background janitors keep running after a failing pass, and stop when told."""

from __future__ import annotations

import logging
import threading

import pytest

from kvfabric.cacheserver.engine.periodic import start_periodic


def test_a_failing_pass_is_logged_and_the_next_one_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    calls: list[int] = []
    second = threading.Event()

    def tick() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise OSError("first pass fails")
        second.set()

    log = logging.getLogger("test.periodic")
    with caplog.at_level(logging.ERROR, logger="test.periodic"):
        th = start_periodic("janitor", tick, 0.001, stop, log)
        assert second.wait(30), "the pass after a failure never ran"
        stop.set()
        th.join(30)
    assert not th.is_alive()
    assert th.daemon
    assert th.name == "janitor"
    failures = [r for r in caplog.records if r.getMessage() == "background task failed"]
    assert len(failures) == 1
    assert getattr(failures[0], "task", None) == "janitor"


def test_a_stopped_task_never_runs() -> None:
    stop = threading.Event()
    stop.set()
    ran = threading.Event()
    th = start_periodic("janitor", ran.set, 0.001, stop, logging.getLogger("test.periodic"))
    th.join(30)
    assert not th.is_alive()
    assert not ran.is_set()
