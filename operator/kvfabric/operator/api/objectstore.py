"""The object-store tier's grammar: its endpoint, its bucket name, its Secret keys and its region.

Each rule is written once as a regular expression (syntax that Go's RE2 and Python's ``re`` read
alike) and becomes both a CEL ``x-kubernetes-validations`` rule of the CRD (:func:`cel_rules`) and a
pydantic after-validator (:func:`checker`), with the same message naming the field. So the API server
rejects a bad pool at admission, and a pool stored before a rule existed shows ``ConfigValid=False``
instead of being rendered.

The rules are CEL rather than OpenAPI patterns where the message matters: a pattern's error echoes
the value and only says "should match", CEL's says what is wrong and never echoes the value (an
endpoint with credentials in it would otherwise put them into every client's error message).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class Rule:
    """A value must (or must not) contain a match of ``pattern``; ``message`` follows the field path."""

    pattern: str
    must_match: bool
    message: str

    def holds(self, value: str) -> bool:
        """Whether ``value`` satisfies the rule (``re.search``: CEL's ``matches`` is unanchored too)."""
        # RE2's '$' is the end of the text, as Python's '\Z'; Python's '$' also matches before a final
        # newline, which would let "bucket\n" through here while the API server refuses it.
        python_pattern = re.sub(r"(?<!\\)\$", r"\\Z", self.pattern)
        return (re.search(python_pattern, value) is not None) == self.must_match

    def cel(self, path: str) -> dict[str, str]:
        """The rule as a CEL validation on the field at ``path``."""
        assert "'" not in self.pattern, "the pattern is embedded in a CEL raw string"
        test = f"self.matches(r'{self.pattern}')"
        return {"rule": test if self.must_match else f"!{test}", "message": f"{path} {self.message}"}


def cel_rules(path: str, rules: Sequence[Rule]) -> list[dict[str, str]]:
    """The CEL validations of the field at ``path``."""
    return [rule.cel(path) for rule in rules]


def checker(path: str, rules: Sequence[Rule]) -> Callable[[str], str]:
    """A pydantic after-validator applying ``rules``: the first broken one raises its message."""

    def check(value: str) -> str:
        for rule in rules:
            if not rule.holds(value):
                raise ValueError(f"{path} {rule.message}")
        return value

    return check


# --- endpoint -------------------------------------------------------------------------------------
_LABEL: Final = r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?"
# A DNS name or IPv4 address (both fit the label grammar), or a bracketed IPv6 address.
_HOST: Final = rf"({_LABEL}(\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_PORT: Final = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"

ENDPOINT_PATH: Final = "spec.tiers.objectStore.endpoint"
ENDPOINT_RULES: Final = (
    Rule(r"^https?://", True, "must start with http:// or https://"),
    # Userinfo (user:password@) would put the key pair into the server's ConfigMap, readable by
    # whoever may read ConfigMaps in the namespace and copied into every log line naming the endpoint.
    Rule(
        r"^[A-Za-z][-+.A-Za-z0-9]*://[^/?#]*@",
        False,
        "must not embed credentials (user:password@host): put the key pair in a Secret and name it "
        "in spec.tiers.objectStore.credentials",
    ),
    Rule(
        rf"^https?://{_HOST}(:{_PORT})?/?$",
        True,
        "must be http(s)://host[:port] with no path, query or fragment (host: a DNS name or an IP "
        "address, port 1-65535)",
    ),
)

# --- bucket ---------------------------------------------------------------------------------------
# The S3 naming rules for general-purpose buckets (3 to 63 characters is the field's min/maxLength).
# Each '.'-separated label must also be a DNS label (no '.-' or '-.'): virtual-hosted requests put
# the bucket into the host name, and S3-compatible servers (MinIO's strict check) refuse them.
BUCKET_PATH: Final = "spec.tiers.objectStore.bucket"
BUCKET_RESERVED_PREFIXES: Final = ("xn--", "sthree-", "amzn-s3-demo-")
BUCKET_RESERVED_SUFFIXES: Final = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
BUCKET_RULES: Final = (
    Rule(
        r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$",
        True,
        "must be lower-case letters, digits, '.' and '-', and begin and end with a letter or digit "
        "(an S3 bucket name)",
    ),
    Rule(
        r"\.\.|\.-|-\.",
        False,
        "must not contain '..', '.-' or '-.' (each '.'-separated label is a DNS label)",
    ),
    Rule(r"^([0-9]+\.){3}[0-9]+$", False, "must not be formatted as an IP address"),
    Rule(
        "^(" + "|".join(p.replace(".", r"\.") for p in BUCKET_RESERVED_PREFIXES) + ")",
        False,
        f"must not start with a prefix S3 reserves ({', '.join(BUCKET_RESERVED_PREFIXES)})",
    ),
    Rule(
        "(" + "|".join(s.replace(".", r"\.") for s in BUCKET_RESERVED_SUFFIXES) + ")$",
        False,
        f"must not end with a suffix S3 reserves ({', '.join(BUCKET_RESERVED_SUFFIXES)})",
    ),
)

# --- Secret and ConfigMap keys (k8s.io/apimachinery IsConfigMapKey) --------------------------------
# Letters, digits, '-', '_' and '.', not '.' or '..' nor starting with '..': the key also names a file
# in the mounted volume, so '..' would point the server outside it.
KEY_PATTERN: Final = r"^\.?[-_A-Za-z0-9][-._A-Za-z0-9]*$"

# --- region ---------------------------------------------------------------------------------------
# Part of every request's SigV4 credential scope ('<date>/<region>/s3/aws4_request'): no '/' or spaces.
REGION_PATTERN: Final = r"^[A-Za-z0-9][-_.A-Za-z0-9]*$"
