"""Units of memory, written once for the whole package."""

from __future__ import annotations

import re

MiB = 1 << 20
GiB = 1 << 30

DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """A size as vLLM's ``--kv-cache-memory-bytes`` reads it: ``2147483648``, ``2G`` (GiB:
    upper case is binary), ``2.5g`` (10⁹: lower case is decimal). Raises ValueError naming
    what it takes."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])?", value)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: bytes, or a number with K M G T (binary) or k m g t (decimal)"
        )
    number, suffix = match.groups()
    if suffix is None:
        if "." in number:
            raise ValueError(f"{text!r} is not a whole number of bytes")
        return int(number)
    if suffix in BINARY:
        if "." in number:
            raise ValueError(f"{text!r}: no decimals with a binary suffix ({suffix})")
        return int(number) * BINARY[suffix]
    return int(float(number) * DECIMAL[suffix])
