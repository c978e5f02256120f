"""Kubernetes resource quantities ("64Gi", "1.5T", "500M", "1e9") to integer bytes.

The cache server's configuration takes plain integers; the pool spec takes quantities because that
is what Kubernetes users write. Parsing follows ``k8s.io/apimachinery/pkg/api/resource``: binary
suffixes (Ki…Ei), decimal suffixes (k, M, G, T, P, E, and the sub-unit m/u/n), and decimal exponents.
Fractions of a byte round up, as the API server does when it canonicalises a quantity.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Final

_BINARY: Final = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: Final = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_PATTERN: Final = re.compile(
    r"^\s*([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?\s*$"
)


class QuantityError(ValueError):
    """Raised for a string that is not a Kubernetes quantity."""


def parse_quantity(value: str | int) -> Fraction:
    """Return the exact value of a quantity as a fraction (``"1.5Gi"`` → ``1610612736``)."""
    if isinstance(value, int):
        return Fraction(value)
    match = _PATTERN.match(value)
    if match is None:
        raise QuantityError(f"not a Kubernetes quantity: {value!r}")
    number, exponent, suffix = match.groups()
    try:
        base = Fraction(Decimal(number))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid decimals
        raise QuantityError(f"not a Kubernetes quantity: {value!r}") from exc
    if exponent is not None:
        return base * Fraction(10) ** int(exponent[1:])
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    return base * _DECIMAL[suffix or ""]


def to_bytes(value: str | int) -> int:
    """Return a quantity as whole bytes, rounding a fractional byte up; negative values are rejected."""
    exact = parse_quantity(value)
    if exact < 0:
        raise QuantityError(f"a byte size cannot be negative: {value!r}")
    whole = exact.numerator // exact.denominator
    return whole + (1 if exact.numerator % exact.denominator else 0)


def format_bytes(value: int) -> str:
    """Return the shortest exact binary-suffixed quantity for ``value`` bytes (``1073741824`` → ``1Gi``)."""
    for suffix, factor in sorted(_BINARY.items(), key=lambda item: -item[1]):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)
