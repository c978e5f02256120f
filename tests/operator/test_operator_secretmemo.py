"""SecretMemo: a Secret read or written lately answers a read; an older one, or none, asks the API."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.operator.secretmemo import SecretMemo


class Api:
    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.gets: list[tuple[str, str]] = []

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind == "Secret"
        self.gets.append((str(namespace), name))
        return self.secrets.get((str(namespace), name))


def _secret(value: str) -> dict[str, Any]:
    return {"metadata": {"name": "s", "namespace": "ns"}, "data": {"k": value}}


@pytest.mark.asyncio
async def test_a_read_is_trusted_for_max_age_then_read_again() -> None:
    now = [0.0]
    api = Api()
    api.secrets["ns", "s"] = _secret("a")
    memo = SecretMemo(api, max_age=30.0, clock=lambda: now[0])
    assert await memo.get("ns", "s") == _secret("a")
    api.secrets["ns", "s"] = _secret("b")  # changed by someone else
    now[0] = 29.9
    assert await memo.get("ns", "s") == _secret("a")
    assert len(api.gets) == 1
    now[0] = 30.0
    assert await memo.get("ns", "s") == _secret("b")
    assert len(api.gets) == 2
    assert memo.reads == 2


@pytest.mark.asyncio
async def test_absence_is_remembered_like_presence_and_fresh_always_asks() -> None:
    api = Api()
    memo = SecretMemo(api, max_age=30.0, clock=lambda: 0.0)
    assert await memo.get("ns", "s") is None
    api.secrets["ns", "s"] = _secret("a")
    assert await memo.get("ns", "s") is None
    assert await memo.get("ns", "s", fresh=True) == _secret("a")
    assert len(api.gets) == 2


@pytest.mark.asyncio
async def test_a_write_answer_is_remembered_and_forget_or_an_answer_without_data_asks_again() -> None:
    api = Api()
    memo = SecretMemo(api, max_age=30.0, clock=lambda: 0.0)
    memo.put(_secret("w"), "ns", "s")
    assert await memo.get("ns", "s") == _secret("w")
    assert api.gets == []
    memo.forget("ns", "s")
    assert await memo.get("ns", "s") is None
    assert len(api.gets) == 1
    memo.put({"kind": "Status"}, "ns", "s")  # not the object: nothing is known
    api.secrets["ns", "s"] = _secret("x")
    assert await memo.get("ns", "s") == _secret("x")
    assert len(api.gets) == 2
    memo.put(None, "ns", "s")  # deleted by this replica
    assert await memo.get("ns", "s") is None
    assert len(api.gets) == 2
