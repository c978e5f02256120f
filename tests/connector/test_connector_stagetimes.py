"""The debug stage timings of a hit: nothing recorded when off, one line per loading step when on."""

from __future__ import annotations

import logging

import pytest

from kvfabric.connector import stagetimes


@pytest.fixture(autouse=True)
def _clean() -> None:
    stagetimes.take()


def test_off_records_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(stagetimes, "ENABLED", False)
    with stagetimes.stage("scatter"):
        pass
    stagetimes.add("step", 1.0, 1.0)
    with caplog.at_level(logging.DEBUG, logger="kvfabric.stages"):
        stagetimes.flush("step")
    assert stagetimes.take() == {}
    assert caplog.records == []


def test_on_sums_each_stage_and_flushes_only_after_the_named_stage(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(stagetimes, "ENABLED", True)
    monkeypatch.setattr(stagetimes.log, "propagate", True)
    stagetimes.add("lookup", 0.001, 0.0005)
    stagetimes.add("lookup", 0.002, 0.0005)
    with caplog.at_level(logging.DEBUG, logger="kvfabric.stages"):
        stagetimes.flush("step")  # no step yet: the lookup waits for its step's line
        assert caplog.records == []
        with stagetimes.stage("scatter"):
            sum(range(1000))
        stagetimes.add("step", 0.010, 0.004)
        stagetimes.flush("step")
    (rec,) = caplog.records
    line = rec.getMessage()
    assert line.startswith("kvfabric stages: lookup=3.00/1.00 scatter=")
    assert line.endswith(" step=10.00/4.00")
    assert stagetimes.take() == {}
