"""A load cancelled at its deadline while the pool opens a block closes that block when it opens.

The server bounds a Load stream by its deadline; the await on the load pool is then cancelled while
the pool's thread goes on opening the block. Its file descriptor (and, for an evicted DRAM block,
the tmpfs file's memory) must not be leaked: the block is closed as soon as the thread returns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from kvfabric.cacheserver.service import CacheService


class _Block:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_block_opened_after_its_load_was_cancelled_is_closed() -> None:
    block = _Block()
    opening, release = threading.Event(), threading.Event()

    def open_one() -> _Block:
        opening.set()
        release.wait(30)
        return block

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            service = SimpleNamespace(s=SimpleNamespace(load_pool=pool))
            task = asyncio.ensure_future(CacheService._opened_in_pool(service, open_one))  # type: ignore[arg-type]
            await asyncio.to_thread(opening.wait, 30)  # the pool's thread is opening the block
            task.cancel()  # the stream's deadline
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert not block.closed.is_set()
            release.set()  # the thread opens the block after nobody awaits it any more
        assert block.closed.wait(10), "the block opened for a cancelled load was never closed"

    asyncio.run(scenario())
