"""Leader election under hanging and slow Lease requests, on an event loop with virtual time.

The real :class:`LeaseElector` runs against an in-memory Lease (compare-and-swap on the
resourceVersion, as the API server does) whose requests can be delayed, hang for ever, hang while
ignoring their cancellation (a client that only gives up after its own 30 s timeout), or be applied
by the server while the answer never comes back. Virtual time (the loop's clock advances to the next
timer instead of sleeping) makes the timing exact and a run of minutes take milliseconds.

- A leader whose renewal hangs steps down exactly ``renew_deadline_seconds`` after the start of its
  last successful renewal, whether or not the hanging call returns.
- Model-based: two replicas under generated delays and hangs never lead at the same time, and once
  the network is healthy again one of them leads.
"""

from __future__ import annotations

import asyncio
import copy
import math
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.leader import LeaseElector, Tenure

# --- an event loop whose clock is virtual ---------------------------------------------------------


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: a wait for ``timeout`` moves the loop's clock forward by ``timeout``."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("virtual loop: every task waits for ever")
            self.clock[0] += timeout
            if self.clock[0] > START + VIRTUAL_LIMIT:
                # A task that swallowed its cancellation would otherwise spin here for ever.
                raise RuntimeError(f"virtual loop: still running after {VIRTUAL_LIMIT:.0f} s")
        return ready


START = 1000.0
VIRTUAL_LIMIT = 3600.0


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual (starts at :data:`START`)."""

    def __init__(self) -> None:
        self.clock = [START]
        super().__init__(selector=_VirtualSelector(self.clock))

    def time(self) -> float:
        return self.clock[0]


def run_virtual(main: Callable[[], Any]) -> Any:
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        # Stubborn requests swallow cancellation until their own timeout: run them out (virtual time).
        loop.run_until_complete(asyncio.wait(pending, timeout=120) if pending else asyncio.sleep(0))
        loop.close()


# --- an in-memory Lease behind a network that misbehaves on request -------------------------------

STUBBORN_TIMEOUT = 30.0  # the client's own timeout, the only bound of a stubborn request


@dataclass(frozen=True)
class Behaviour:
    """How one request fares: delays before and after the server applies it, or a hang."""

    request_delay: float = 0.0
    response_delay: float = 0.0
    hang: str | None = None  # "before" (never applied) | "after" (applied, no answer)
    stubborn: bool = False  # ignores cancellation until STUBBORN_TIMEOUT


FAST = Behaviour()


class LeaseStore:
    """One Lease with the API server's compare-and-swap."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None
        self.version = 0

    def get(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.record)

    def write(self, body: dict[str, Any], *, create: bool) -> dict[str, Any]:
        path = "/leases/x"
        if create and self.record is not None:
            raise ApiError(409, "exists", method="POST", path=path)
        if not create:
            if self.record is None:
                raise ApiError(404, "not found", method="PUT", path=path)
            if body["metadata"].get("resourceVersion") != self.record["metadata"]["resourceVersion"]:
                raise ApiError(409, "conflict", method="PUT", path=path)
        self.version += 1
        self.record = copy.deepcopy(body)
        self.record["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.record)


async def _wait(seconds: float, *, stubborn: bool) -> None:
    loop = asyncio.get_running_loop()
    if not stubborn:
        if math.isinf(seconds):
            await loop.create_future()
        await asyncio.sleep(seconds)
        return
    end = loop.time() + min(seconds, STUBBORN_TIMEOUT)
    while loop.time() < end:
        try:
            await asyncio.sleep(end - loop.time())
        except asyncio.CancelledError:
            continue  # a client that ignores cancellation
    if seconds > STUBBORN_TIMEOUT:
        raise TimeoutError("the client's own timeout")


@dataclass(frozen=True)
class Fault:
    """Requests a replica starts between ``start`` and ``end`` (seconds into the run) fare so."""

    start: float
    end: float
    behaviour: Behaviour


class FakeClient:
    """The three calls the elector makes, each faring as ``fate(call index, seconds into the run)``."""

    def __init__(self, store: LeaseStore, fate: Callable[[int, float], Behaviour]) -> None:
        self.store = store
        self.fate = fate
        self.calls: list[tuple[str, float]] = []  # (call, loop time it started)

    async def _play(self, name: str, apply: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        self.calls.append((name, loop.time()))
        b = self.fate(len(self.calls) - 1, loop.time() - START)
        await _wait(math.inf if b.hang == "before" else b.request_delay, stubborn=b.stubborn)
        try:
            result = apply()
        except ApiError as exc:
            await _wait(b.response_delay, stubborn=b.stubborn)
            raise exc from None
        await _wait(math.inf if b.hang == "after" else b.response_delay, stubborn=b.stubborn)
        return result

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self._play("get", self.store.get)  # type: ignore[no-any-return]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._play("create", lambda: self.store.write(obj, create=True))  # type: ignore[no-any-return]

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._play("replace", lambda: self.store.write(obj, create=False))  # type: ignore[no-any-return]


def faulty(faults: list[Fault], base: Behaviour = FAST) -> Callable[[int, float], Behaviour]:
    """A fate: the first fault whose window holds the request's start, else ``base``."""

    def fate(_index: int, at: float) -> Behaviour:
        return next((f.behaviour for f in faults if f.start <= at < f.end), base)

    return fate


@dataclass
class Span:
    """One term of leading: [start, end) in loop time (end None: still leading)."""

    start: float
    end: float | None = None


@dataclass
class Terms:
    """When one replica led."""

    identity: str
    spans: list[Span] = field(default_factory=list)

    async def lead(self) -> None:
        loop = asyncio.get_running_loop()
        span = Span(loop.time())
        self.spans.append(span)
        try:
            await loop.create_future()
        finally:
            span.end = loop.time()


def elector(client: FakeClient, identity: str) -> LeaseElector:
    return LeaseElector(client, namespace="ns", name="x", identity=identity)  # type: ignore[arg-type]


# --- the bound -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hang", ["before", "after"])
@pytest.mark.parametrize("stubborn", [False, True], ids=["cancellable", "stubborn"])
def test_a_hanging_renewal_steps_down_at_the_renew_deadline(hang: str, stubborn: bool) -> None:
    """Renewals succeed, then one hangs: the leader stops leading by its deadline, not the call's end."""
    store = LeaseStore()
    # Acquire (get, create) and two renewals (get, replace each); then every replace hangs.
    hanging = Behaviour(hang=hang, stubborn=stubborn)
    client = FakeClient(store, lambda i, _at: FAST if i < 6 or i % 2 == 0 else hanging)
    terms = Terms("a")

    async def main() -> LeaseElector:
        e = elector(client, "a")
        runner = asyncio.ensure_future(e.run(terms.lead))
        await asyncio.sleep(60)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        return e

    e = run_virtual(main)
    assert terms.spans, "never led"
    end = terms.spans[0].end
    assert end is not None, "still leading a minute after its renewals began to hang"
    # The last successful renewal began with its GET: the third round (acquire, renew, renew).
    gets = [t for call, t in client.calls if call == "get"]
    last_success = gets[2]
    assert end - last_success == pytest.approx(e.renew_deadline_seconds)
    assert end - last_success < e.lease_seconds


def test_a_leader_that_sees_another_holder_steps_down_at_once() -> None:
    store = LeaseStore()
    client = FakeClient(store, faulty([]))
    terms = Terms("a")

    async def main() -> None:
        runner = asyncio.ensure_future(elector(client, "a").run(terms.lead))
        await asyncio.sleep(1)
        record = store.get()
        assert record is not None
        record["spec"]["holderIdentity"] = "b"
        store.write(record, create=False)
        await asyncio.sleep(5)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    run_virtual(main)
    end = terms.spans[0].end
    assert end is not None
    assert end - START <= 1 + 3 + 1e-6  # the next renewal (every 3 s) sees b


def test_the_timeouts_must_fit_inside_the_lease() -> None:
    client: KubeClient = FakeClient(LeaseStore(), faulty([]))  # type: ignore[assignment]
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaseElector(client, namespace="n", name="x", identity="a", renew_deadline_seconds=10.0)
    with pytest.raises(ValueError, match="attempt timeout < renew deadline"):
        LeaseElector(client, namespace="n", name="x", identity="a", attempt_timeout_seconds=7.0)


def test_tenure_counts_from_the_start_of_the_last_success() -> None:
    tenure = Tenure(renewed_at=100.0, deadline=7.0)
    assert not tenure.over(106.9)
    assert tenure.over(107.0)
    tenure.renewed(103.0)
    tenure.renewed(102.0)  # a slower, earlier attempt answering late does not move it back
    assert tenure.ends_at == 110.0


# --- two replicas, generated misbehaviour ----------------------------------------------------------

_DELAYS = [0.0, 0.01, 0.5, 1.9, 2.5, 6.0, 12.0]
behaviours = st.builds(
    Behaviour,
    request_delay=st.sampled_from(_DELAYS),
    response_delay=st.sampled_from(_DELAYS),
    hang=st.sampled_from([None, "before", "after"]),
    stubborn=st.booleans(),
)
# Incidents: from a second into the run to a minute, a few seconds to longer than a lease.
faults = st.builds(
    lambda start, length, b: Fault(start, start + length, b),
    st.floats(0, 60, allow_nan=False).map(lambda x: round(x, 1)),
    st.sampled_from([0.5, 2.0, 4.0, 8.0, 15.0, 40.0]),
    behaviours,
)
bases = st.builds(
    Behaviour,
    request_delay=st.sampled_from([0.0, 0.001, 0.2]),
    response_delay=st.sampled_from([0.0, 0.001, 0.2]),
)


@settings(max_examples=200, deadline=None)
@given(
    faults_a=st.lists(faults, max_size=4),
    faults_b=st.lists(faults, max_size=4),
    base_a=bases,
    base_b=bases,
    b_starts=st.sampled_from([0.0, 0.5, 3.0, 11.0]),
)
def test_two_replicas_never_lead_at_once(
    faults_a: list[Fault], faults_b: list[Fault], base_a: Behaviour, base_b: Behaviour, b_starts: float
) -> None:
    store = LeaseStore()
    a, b = Terms("a"), Terms("b")

    async def main() -> None:
        runners = [
            asyncio.ensure_future(elector(FakeClient(store, faulty(faults_a, base_a)), "a").run(a.lead))
        ]
        await asyncio.sleep(b_starts)
        client_b = FakeClient(store, faulty(faults_b, base_b))
        runners.append(asyncio.ensure_future(elector(client_b, "b").run(b.lead)))
        await asyncio.sleep(300)  # faults end by 100 s, stubborn requests 30 s later: healthy at the end
        leaders = [t.identity for t in (a, b) if t.spans and t.spans[-1].end is None]
        assert len(leaders) == 1, f"leaders at the end: {leaders}"
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)

    run_virtual(main)
    for x in a.spans:
        for y in b.spans:
            assert x.end is not None
            assert y.end is not None
            assert x.end <= y.start or y.end <= x.start, (a.spans, b.spans)
