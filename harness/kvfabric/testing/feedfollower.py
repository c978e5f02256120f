"""A residency-feed subscriber for tests: each key's tiers and names as the feed says them."""

from __future__ import annotations

from collections.abc import Callable

from kvfabric.client.residency import FeedMessage, ResidencyFeedClient
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, residency_socket_for
from kvfabric.testing.serverproc import ServerProcess, wait_until


class Follower:
    """Subscribes to ``namespace`` on ``srv`` and waits for its snapshot.

    ``metas`` holds each key's names from its latest ``stored`` record; with ``keep_unnamed`` a
    record without names replaces them (a test of names dropped), else it leaves them as they were.
    """

    def __init__(self, srv: ServerProcess, namespace: str, *, keep_unnamed: bool = False) -> None:
        self.client = ResidencyFeedClient(residency_socket_for(srv.config.listen.unix_socket), namespace)
        self.keep_unnamed = keep_unnamed
        self.log: list[FeedMessage] = []
        self.tiers: dict[str, set[str]] = {}
        self.metas: dict[str, ChunkMeta | None] = {}
        self.until(lambda: ("synced", None) in self.log, "the snapshot")

    def pump(self) -> None:
        """Read what the feed has sent (for up to 50 ms) and apply it."""
        for message in self.client.read(0.05):
            self.log.append(message)
            if isinstance(message, Change):
                tiers = self.tiers.setdefault(message.key, set())
                if message.op == "stored":
                    tiers.add(message.tier)
                    if message.meta is not None or self.keep_unnamed:
                        self.metas[message.key] = message.meta
                else:
                    tiers.discard(message.tier)

    def until(self, pred: Callable[..., object], what: str, timeout: float = 30.0) -> None:
        """Pump until ``pred()`` holds (a clear error naming ``what`` after ``timeout``)."""

        def check() -> bool:
            self.pump()
            return bool(pred())

        wait_until(check, timeout=timeout, what=what)

    def changes(self, key: str) -> list[tuple[str, str]]:
        """``(op, tier)`` of every record about ``key``, in order."""
        return [(m.op, m.tier) for m in self.log if isinstance(m, Change) and m.key == key]

    def close(self) -> None:
        """Close the subscription."""
        self.client.close()
