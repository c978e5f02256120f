"""Block identities: a namespace digest and a key digest, validated before they touch a path."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BlockId", "InvalidId", "parse_ids"]

_HEX64 = re.compile(r"[0-9a-f]{64}")


class InvalidId(ValueError):  # noqa: N818 - reads better at the call sites than InvalidIdError
    """A namespace or key that is not 64 lower-case hex characters."""


@dataclass(frozen=True, slots=True)
class BlockId:
    """One chunk: ``(namespace, key)``, both 64-char lower-case hex (32-byte digests).

    Construct through :func:`parse_ids` or :meth:`parse`, which validate; the hex form is what
    appears in file names, so validation is what keeps client input from becoming an arbitrary path.
    """

    namespace: str
    key: str

    @classmethod
    def parse(cls, namespace: str, key: str) -> BlockId:
        """Validate and build one id."""
        if not _HEX64.fullmatch(namespace):
            raise InvalidId(f"namespace must be 64 lower-case hex characters, got {namespace[:80]!r}")
        if not _HEX64.fullmatch(key):
            raise InvalidId(f"key must be 64 lower-case hex characters, got {key[:80]!r}")
        return cls(namespace, key)

    @property
    def filename(self) -> str:
        """File name of this block in a bucket directory."""
        return f"{self.namespace}_{self.key}.blk"

    @classmethod
    def from_filename(cls, name: str) -> BlockId | None:
        """Inverse of :attr:`filename`; None for anything that is not a block file name."""
        if len(name) != 133 or not name.endswith(".blk") or name[64] != "_":
            return None
        try:
            return cls.parse(name[:64], name[65:129])
        except InvalidId:
            return None


def parse_ids(namespace: str, keys: list[str] | tuple[str, ...]) -> list[BlockId]:
    """Validate a namespace and an ordered list of keys."""
    if not _HEX64.fullmatch(namespace):
        raise InvalidId(f"namespace must be 64 lower-case hex characters, got {namespace[:80]!r}")
    out = []
    for i, key in enumerate(keys):
        if not _HEX64.fullmatch(key):
            raise InvalidId(f"keys[{i}] must be 64 lower-case hex characters, got {key[:80]!r}")
        out.append(BlockId(namespace, key))
    return out
