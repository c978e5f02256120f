"""Kubernetes quantities to bytes."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvfabric.operator.quantity import QuantityError, format_bytes, parse_quantity, to_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("1Ki", 1024),
        ("64Gi", 64 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("1Ti", 2**40),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("2G", 2_000_000_000),
        ("1e3", 1000),
        ("1.5E2", 150),
        ("1500m", 2),  # 1.5 bytes round up
        ("+3Mi", 3 * 2**20),
        (".5Ki", 512),
        (4096, 4096),
    ],
)
def test_to_bytes(text: str | int, expected: int) -> None:
    assert to_bytes(text) == expected


def test_exact_fraction() -> None:
    assert parse_quantity("100m") == Fraction(1, 10)


@pytest.mark.parametrize("text", ["", "Gi", "1GB", "1 Gi x", "lots", "1.2.3", "--1"])
def test_rejects_garbage(text: str) -> None:
    with pytest.raises(QuantityError):
        to_bytes(text)


def test_negative_bytes_rejected() -> None:
    with pytest.raises(QuantityError):
        to_bytes("-1Gi")


def test_format_bytes_round_trips() -> None:
    for value in (1, 1023, 1024, 3 * 2**29, 64 * 2**30, 5 * 2**40):
        assert to_bytes(format_bytes(value)) == value
    assert format_bytes(2**30) == "1Gi"
