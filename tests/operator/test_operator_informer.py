"""Informer caches: paginated list, watch, relist on 410, indexes; the reader answers from them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvfabric.operator.informer import CachedReader, Informer, parse_selector
from kvfabric.operator.kube import ApiError


def pod(name: str, pool: str, ns: str = "ns", rv: str = "1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"kvfabric.io/pool": pool},
            "resourceVersion": rv,
        }
    }


class FakeApi:
    """Pages of a list, then scripted watch streams; records every request."""

    def __init__(self, items: list[dict[str, Any]], streams: list[list[dict[str, Any]]]) -> None:
        self.items = items
        self.streams = streams
        self.lists = 0
        self.watches: list[dict[str, str]] = []
        self.fallback_lists = 0
        self.done = asyncio.Event()

    async def list_page(self, kind: str, namespace: str | None, params: dict[str, str]) -> dict[str, Any]:
        self.lists += 1
        start = int(params.get("continue", "0"))
        page = self.items[start : start + 2]
        more = start + 2 < len(self.items)
        return {
            "items": page,
            "metadata": {"resourceVersion": "10", **({"continue": str(start + 2)} if more else {})},
        }

    async def watch(
        self, kind: str, namespace: str | None, params: dict[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        self.watches.append(params)
        if not self.streams:
            self.done.set()
            await asyncio.Event().wait()
        for event in self.streams.pop(0):
            if event.get("raise") == 410:
                raise ApiError(410, "gone", method="WATCH", path="pods")
            yield event

    async def list(self, kind: str, namespace: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        self.fallback_lists += 1
        return []

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return None


async def run_until_idle(informer: Informer, api: FakeApi) -> None:
    task = asyncio.ensure_future(informer.run())
    await asyncio.wait_for(api.done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_list_pages_watch_and_index() -> None:
    api = FakeApi(
        [pod("a", "p1"), pod("b", "p1"), pod("c", "p2")],
        [
            [
                {"type": "ADDED", "object": pod("d", "p2", rv="11")},
                {"type": "MODIFIED", "object": pod("a", "p2", rv="12")},  # relabelled to another pool
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "13"}}},
                {"type": "DELETED", "object": pod("b", "p1", rv="14")},
            ]
        ],
    )
    changed: list[str] = []
    informer = Informer(
        api,  # type: ignore[arg-type]
        "Pod",
        label_selector="kvfabric.io/pool",
        index_label="kvfabric.io/pool",
        on_change=lambda o: changed.append(o["metadata"]["name"]),
    )
    await run_until_idle(informer, api)
    assert api.lists == 2  # two pages
    assert api.watches[0]["resourceVersion"] == "10"
    assert api.watches[1]["resourceVersion"] == "14"  # resumes after the last event (bookmarks count)
    assert sorted(o["metadata"]["name"] for o in informer.by_index("p2")) == ["a", "c", "d"]
    assert informer.by_index("p1") == []
    assert changed == ["a", "b", "c", "d", "a", "b"]


@pytest.mark.asyncio
async def test_expired_watch_relists_and_drops_vanished_objects() -> None:
    api = FakeApi([pod("a", "p1"), pod("b", "p1")], [[{"raise": 410}]])
    informer = Informer(api, "Pod", label_selector="kvfabric.io/pool", index_label="kvfabric.io/pool")  # type: ignore[arg-type]
    task = asyncio.ensure_future(informer.run())
    await asyncio.wait_for(informer.synced.wait(), 5)
    api.items = [pod("b", "p1", rv="20")]  # "a" was deleted while the watch was down
    await asyncio.wait_for(api.done.wait(), 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert informer.relists == 2
    assert [o["metadata"]["name"] for o in informer.by_index("p1")] == ["b"]


@pytest.mark.asyncio
async def test_reader_uses_the_index_only_for_covered_selectors() -> None:
    api = FakeApi([pod("a", "p1"), pod("x", "p1", ns="other")], [])
    informer = Informer(api, "Pod", label_selector="kvfabric.io/pool", index_label="kvfabric.io/pool")  # type: ignore[arg-type]
    reader = CachedReader(api, [informer])  # type: ignore[arg-type]
    # Not synced yet: the API server answers.
    await reader.list("Pod", None, label_selector="kvfabric.io/pool=p1")
    assert api.fallback_lists == 1
    await run_until_idle(informer, api)
    informer.synced.set()
    got = await reader.list("Pod", None, label_selector="kvfabric.io/pool=p1")
    assert sorted(o["metadata"]["name"] for o in got) == ["a", "x"]
    assert [
        o["metadata"]["name"] for o in await reader.list("Pod", "ns", label_selector="kvfabric.io/pool=p1")
    ] == ["a"]
    assert api.fallback_lists == 1
    # Another label, a set-based selector or a field selector are not covered by this cache.
    await reader.list("Pod", "ns", label_selector="app=x")
    await reader.list("Pod", "ns", label_selector="kvfabric.io/pool in (p1)")
    await reader.list("Pod", "ns", label_selector="kvfabric.io/pool=p1", field_selector="spec.nodeName=n")
    assert api.fallback_lists == 4
    assert await reader.get("Pod", "ns", "a") is not None


def test_parse_selector() -> None:
    assert parse_selector("a=b,c") == ({"a": "b"}, {"c"})
    assert parse_selector("a!=b") is None
    assert parse_selector("a in (b)") is None
    assert parse_selector("") == ({}, set())
