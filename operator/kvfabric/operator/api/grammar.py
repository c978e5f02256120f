"""Grammars and bounds the API enforces twice: as OpenAPI patterns/CEL in the CRD, and in Python.

The API server rejects a nonsense pool at admission (``crds/`` is generated from the models); the same
rules run in pydantic when the reconciler or the webhook parses a pool, so an object stored before a
rule existed is reported (``ConfigValid=False``) instead of rendered. Regular expressions here use
only syntax that Go's RE2 (OpenAPI ``pattern`` and CEL ``matches``) and Python's ``re`` read alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Final

from kvfabric.operator.quantity import QuantityError, parse_quantity

# --- labels (k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsValidLabelValue) ---------
_DNS_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN: Final = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
DNS_SUBDOMAIN_PATTERN: Final = rf"^{DNS_SUBDOMAIN}$"
_LABEL_NAME: Final = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_PATTERN: Final = rf"^({DNS_SUBDOMAIN}/)?{_LABEL_NAME}$"
LABEL_VALUE_PATTERN: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
LABEL_KEY_MAX: Final = 253 + 1 + 63

# --- image references (github.com/distribution/reference), lower-case registry included ---------
_PATH_COMPONENT: Final = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_DOMAIN: Final = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*(:[0-9]{{1,5}})?"
IMAGE_REPOSITORY: Final = rf"({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*"
IMAGE_REPOSITORY_PATTERN: Final = rf"^{IMAGE_REPOSITORY}$"
IMAGE_TAG: Final = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
IMAGE_DIGEST: Final = r"@sha256:[a-f0-9]{64}"
IMAGE_REFERENCE_PATTERN: Final = rf"^{IMAGE_REPOSITORY}(:{IMAGE_TAG})?({IMAGE_DIGEST})?$"

# --- host paths ---------------------------------------------------------------------------------
# No control characters (a trailing newline from a YAML block scalar makes a different directory).
HOST_PATH_PATTERN: Final = r"^/[^\x00-\x1f\x7f]*$"

# --- quantities ---------------------------------------------------------------------------------
# Whole bytes: no sub-unit suffixes (m, u, n), no sign, an exponent of at most two digits. A decimal
# point is allowed when the result is whole ("1.5Gi"). Not CEL's isInteger(), which is false for every
# value its parser keeps as a decimal (any binary suffix with a point, "100Ti" and up, every "Pi"):
# without a point the value is whole, with one its float is (exact below 2**53, above every bound).
BYTES_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?([eE][0-9]{1,2}|[kMGTPE]|[KMGTPE]i)?$"
# Bounds of each kind of size (inclusive). Below the minimum a cache server cannot hold one payload;
# above the maximum the value is a typo (no node has 64Ti of DRAM or a 1Pi local disk per pool).
MEMORY_BOUNDS: Final = ("32Mi", "64Ti")
DISK_BOUNDS: Final = ("1Mi", "1Pi")
RESOURCE_MAX: Final = "64Ti"
RESOURCE_NAMES_PATTERN: Final = r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMG]i)$"


def byte_rules(path: str, bounds: tuple[str, str]) -> list[dict[str, str]]:
    """CEL rules for a whole-byte quantity at ``path`` within ``bounds``."""
    low, high = bounds
    return [
        {
            "rule": "isQuantity(self) && (!self.contains('.') "
            f"|| quantity(self).isGreaterThan(quantity('{high}')) "
            "|| quantity(self).asApproximateFloat() == double(int(quantity(self).asApproximateFloat())))",
            "message": f"{path} must be a whole number of bytes such as 64Gi (not a fraction, not 'm')",
        },
        {
            "rule": f"!isQuantity(self) || quantity(self).compareTo(quantity('{low}')) >= 0 "
            f"&& quantity(self).compareTo(quantity('{high}')) <= 0",
            "message": f"{path} must be between {low} and {high}",
        },
    ]


def whole_bytes(bounds: tuple[str, str]) -> Callable[[str], str]:
    """Return a pydantic after-validator: ``value`` is whole bytes within ``bounds``."""
    low, high = (parse_quantity(b) for b in bounds)

    def check(value: str) -> str:
        if re.fullmatch(BYTES_PATTERN, value) is None:
            raise ValueError(f"{value!r} is not a whole-byte quantity such as 64Gi")
        exact = parse_quantity(value)
        if exact.denominator != 1:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        if not low <= exact <= high:
            raise ValueError(f"{value!r} must be between {bounds[0]} and {bounds[1]}")
        return value

    return check


def check_resources(values: Mapping[str, str]) -> Mapping[str, str]:
    """Pydantic after-validator for ``resources.requests``/``limits`` (mirrors :data:`RESOURCE_RULES`)."""
    top = parse_quantity(RESOURCE_MAX)
    for name, value in values.items():
        if re.fullmatch(RESOURCE_NAMES_PATTERN, name) is None:
            raise ValueError(f"unknown resource {name!r} (cpu, memory, ephemeral-storage, hugepages-*)")
        try:
            exact = parse_quantity(value)
        except QuantityError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        if not 0 < exact < top:
            raise ValueError(f"{name}: {value!r} must be positive and below {RESOURCE_MAX}")
        if name != "cpu" and exact.denominator != 1:
            raise ValueError(f"{name}: {value!r} is not a whole number of bytes")
    return values


def resource_rules(path: str) -> list[dict[str, str]]:
    """CEL rules for a ``requests``/``limits`` map at ``path``."""
    return [
        {
            "rule": f"self.all(k, k.matches(r'{RESOURCE_NAMES_PATTERN}'))",
            "message": f"{path} may name only cpu, memory, ephemeral-storage and hugepages-<size>",
        },
        {
            "rule": "self.all(k, isQuantity(self[k]) && quantity(self[k]).isGreaterThan(quantity('0')) "
            f"&& quantity(self[k]).isLessThan(quantity('{RESOURCE_MAX}')))",
            "message": f"{path}: every quantity must be positive and below {RESOURCE_MAX}",
        },
        {
            "rule": "self.all(k, k == 'cpu' || !isQuantity(self[k]) || quantity(self[k]).isInteger())",
            "message": f"{path}: memory and storage must be whole bytes (e.g. 512Mi, not 100m)",
        },
    ]


def check_label_keys(values: Mapping[str, str]) -> Mapping[str, str]:
    """Pydantic after-validator: every key of a label map is a qualified name."""
    for key in values:
        check_label_key(key)
    return values


def check_label_key(key: str) -> str:
    """Raise ValueError unless ``key`` is a valid label key (``[prefix/]name``)."""
    prefix, _, _name = key.rpartition("/")
    if len(key) > LABEL_KEY_MAX or len(prefix) > 253 or re.fullmatch(LABEL_KEY_PATTERN, key) is None:
        raise ValueError(f"{key!r} is not a valid label key ([dns-subdomain/]name, name <= 63 characters)")
    return key


def label_key_rules(path: str) -> list[dict[str, str]]:
    """CEL rule: every key of the map at ``path`` is a valid label key."""
    return [
        {
            "rule": f"self.all(k, size(k) <= {LABEL_KEY_MAX} && k.matches(r'{LABEL_KEY_PATTERN}'))",
            "message": f"{path}: every key must be a valid label key ([dns-subdomain/]name, name <= 63 "
            "characters)",
        }
    ]
