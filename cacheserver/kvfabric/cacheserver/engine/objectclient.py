"""The S3 client of the object-store tier: obstore (Rust ``object_store``) with bounds and a breaker.

(obstore reports a 404 as the built-in ``FileNotFoundError``; every other failure is an obstore error.)

* **Bounded concurrency**: GETs and PUTs have separate semaphores, so a load never waits behind a
  write-back; a load waits for a GET slot until its deadline, a write-back that finds no PUT slot is
  refused at once (the caller drops and counts it).
* **Timeouts and retries** are obstore's: every request has a connect and a total timeout; 5xx
  answers (S3's ``503 SlowDown`` included), timeouts and dropped connections are retried at most
  ``max_retries`` times with exponential backoff and jitter, never later than ``retry_timeout``.
* **Breaker**: after ``failure_threshold`` consecutive failed requests the client reports itself
  unavailable for ``cooldown_seconds``; the tier then answers lookups with a miss instead of letting
  every load run into its deadline. The first request after the cooldown probes the store again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore.store import S3Store

from kvfabric.cacheserver.config import ObjectStoreTierConfig

if TYPE_CHECKING:
    from obstore import ObjectMeta

__all__ = ["ObjectClient", "ObjectMissing", "ObjectStoreBusy", "ObjectStoreError", "make_store"]


class ObjectStoreError(Exception):
    """A request failed after its retries (or the store is being skipped by the breaker)."""


class ObjectMissing(ObjectStoreError):  # noqa: N818 - a condition, like FileNotFoundError
    """The object does not exist (404)."""


class ObjectStoreBusy(ObjectStoreError):  # noqa: N818
    """No request slot was free in time."""


def _read_secret(path: Any) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def make_store(cfg: ObjectStoreTierConfig) -> S3Store:
    """Build the obstore S3 store for ``cfg`` (credentials and CA read from their files now)."""
    kwargs: dict[str, Any] = {
        "endpoint": cfg.endpoint.rstrip("/"),
        "region": cfg.region,
        "virtual_hosted_style_request": not cfg.path_style,
    }
    if cfg.access_key_id_file is not None and cfg.secret_access_key_file is not None:
        kwargs["access_key_id"] = _read_secret(cfg.access_key_id_file)
        kwargs["secret_access_key"] = _read_secret(cfg.secret_access_key_file)
    if cfg.checksum != "none":
        kwargs["checksum_algorithm"] = cfg.checksum
    client: dict[str, Any] = {
        "allow_http": cfg.endpoint.startswith("http://"),
        "timeout": timedelta(seconds=cfg.request_timeout_seconds),
        "connect_timeout": timedelta(seconds=cfg.connect_timeout_seconds),
    }
    if cfg.ca_file is not None:
        client["root_certificate"] = _read_secret(cfg.ca_file)  # PEM text, not a path
    retry: dict[str, Any] = {
        "max_retries": cfg.max_retries,
        "retry_timeout": timedelta(seconds=cfg.retry_timeout_seconds),
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
    }
    return S3Store(
        cfg.bucket,
        prefix=cfg.prefix,
        client_options=client,  # type: ignore[arg-type]
        retry_config=retry,  # type: ignore[arg-type]
        **kwargs,
    )


class _Breaker:
    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0

    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._open_until

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = 0.0

    def failure(self) -> bool:
        """Record a failure; True when this one opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._failures >= self.threshold and time.monotonic() >= self._open_until:
                self._open_until = time.monotonic() + self.cooldown
                return True
            return False


class ObjectClient:
    """Bounded, breaker-guarded access to one bucket and prefix. Thread-safe."""

    def __init__(self, cfg: ObjectStoreTierConfig, store: S3Store | None = None) -> None:
        self.cfg = cfg
        self.store = store if store is not None else make_store(cfg)
        self._gets = threading.BoundedSemaphore(cfg.max_concurrent_gets)
        self._puts = threading.BoundedSemaphore(cfg.max_concurrent_puts)
        self._breaker = _Breaker(cfg.failure_threshold, cfg.cooldown_seconds)
        self.breaker_trips = 0

    def available(self) -> bool:
        """False while the breaker skips the store."""
        return self._breaker.available()

    def _fail(self, exc: Exception) -> ObjectStoreError:
        if self._breaker.failure():
            self.breaker_trips += 1
        return ObjectStoreError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    # --- reads ---------------------------------------------------------------------------------------

    def get_range(self, path: str, start: int, end: int, *, timeout: float) -> tuple[Any, int, str | None]:
        """Bytes ``[start, end)`` of ``path`` (a buffer), the object's total size and its e-tag."""
        if not self._gets.acquire(timeout=max(timeout, 0.0)):
            raise ObjectStoreBusy("no GET slot free before the deadline")
        try:
            res = obstore.get(self.store, path, options={"range": (start, end)})
            data = res.bytes()
            meta = res.meta
        except FileNotFoundError as exc:
            self._breaker.success()
            raise ObjectMissing(path) from exc
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._gets.release()
        self._breaker.success()
        return data, int(meta["size"]), meta.get("e_tag")

    def get(self, path: str, *, timeout: float) -> bytes:
        """A whole (small) object."""
        if not self._gets.acquire(timeout=max(timeout, 0.0)):
            raise ObjectStoreBusy("no GET slot free before the deadline")
        try:
            data = bytes(obstore.get(self.store, path).bytes())
        except FileNotFoundError as exc:
            self._breaker.success()
            raise ObjectMissing(path) from exc
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._gets.release()
        self._breaker.success()
        return data

    def head(self, path: str) -> ObjectMeta:
        """Metadata of one object (clock reads only; lookups never HEAD)."""
        try:
            meta = obstore.head(self.store, path)
        except FileNotFoundError as exc:
            raise ObjectMissing(path) from exc
        except Exception as exc:
            raise self._fail(exc) from exc
        self._breaker.success()
        return meta

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        """Every object under ``prefix`` (paginated by obstore)."""
        try:
            for batch in obstore.list(self.store, prefix, chunk_size=1000):
                yield from batch
        except Exception as exc:
            raise self._fail(exc) from exc
        self._breaker.success()

    # --- writes --------------------------------------------------------------------------------------

    def _put_slot(self, wait: float) -> None:
        if not self._puts.acquire(timeout=wait) if wait > 0 else not self._puts.acquire(blocking=False):
            raise ObjectStoreBusy("no PUT slot free")

    def put(self, path: str, data: bytes | memoryview, *, wait: float = 0.0) -> str | None:
        """Upload one object in a single PUT (atomic: never visible half-written); returns its e-tag."""
        self._put_slot(wait)
        try:
            res = obstore.put(self.store, path, data, use_multipart=False)
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._puts.release()
        self._breaker.success()
        return res.get("e_tag")

    def copy(self, src: str, dst: str, *, wait: float = 0.0) -> None:
        """Server-side copy (no bytes through this process)."""
        self._put_slot(wait)
        try:
            obstore.copy(self.store, src, dst)
        except FileNotFoundError as exc:
            raise ObjectMissing(src) from exc
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._puts.release()
        self._breaker.success()

    def delete(self, paths: Sequence[str], *, wait: float = 5.0) -> None:
        """Delete objects (bulk DeleteObjects, 1000 per request); deleting a missing object succeeds."""
        if not paths:
            return
        self._put_slot(wait)
        try:
            for i in range(0, len(paths), 1000):
                obstore.delete(self.store, list(paths[i : i + 1000]))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._fail(exc) from exc
        finally:
            self._puts.release()
        self._breaker.success()
