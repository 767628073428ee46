# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The one parser of byte counts, used by every config key and command-line flag that takes a size.

``cpu_bytes_to_use``, the fs tier's ``max_bytes`` and ``min_free_bytes``, and the command's
``--cpu-bytes`` and ``--fs-max-bytes`` all go through ``parse_size``, so they accept exactly the
same forms (``SIZE_FORMS``, also in ``docs/configuration.md``):

* an integer number of bytes: ``4096`` (a JSON number, or a string of digits);
* an integral float: ``4e9`` or ``8000000000.0`` (a JSON number or a string);
* a number and a unit, case-insensitive, with an optional space: ``B``; decimal ``KB``, ``MB``,
  ``GB``, ``TB`` (powers of 1000); binary ``KiB``, ``MiB``, ``GiB``, ``TiB`` and the bare
  ``K``, ``M``, ``G``, ``T`` (powers of 1024). A fraction is fine when the result is a whole
  number of bytes: ``1.5GiB``, ``0.5KiB``.

Refused: booleans, negative numbers, zero (unless the caller allows it), a result that is not a
whole number of bytes (``1.3B``), more than ``MAX_SIZE`` (2**63 - 1), NaN and infinity, unknown
units.

Each caller wraps ``SizeError`` in its own error type, naming its key or flag.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

SIZE_FORMS = (
    "a byte count: an integer (4096), an integral float (4e9), or a number with a unit: "
    "B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024), "
    "e.g. '64MiB' or '1.5GB'"
)
"""What ``parse_size`` accepts, in words (quoted by error messages)."""

MAX_SIZE = 2**63 - 1
"""The largest size accepted: the largest file offset (``off_t``) and ``Py_ssize_t``."""

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # Bare letters are binary, as in `ls -h`, `free -h` and Kubernetes' Ki (a "64M" that meant
    # 64 * 10**6 would surprise nobody less).
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A value that is not a byte count; the message says why and what is accepted."""


def parse_size(value: object, *, allow_zero: bool = False) -> int:
    """Parse a byte count given as a number or a string (see the module docstring for the forms).

    Args:
        value: an ``int``, a ``float`` or a ``str``.
        allow_zero: accept 0 (for bounds where 0 means "off"); otherwise the size must be >= 1.

    Returns:
        The number of bytes.

    Raises:
        SizeError: anything else, with a message that quotes the value and ``SIZE_FORMS``.
    """
    # Exact arithmetic throughout (Fraction, not float): "9007199254740993" and 2**60 + 1 stay
    # what they say, and "1.3B" is refused rather than rounded.
    size: Fraction
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is not a size: expected {SIZE_FORMS}")
    if isinstance(value, int):
        size = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise SizeError(f"{value!r} is not a size: expected {SIZE_FORMS}")
        size = Fraction(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise SizeError(f"{value!r} is not a size: expected {SIZE_FORMS}")
        size = Fraction(match.group(1)) * _UNITS[unit]
    else:
        raise SizeError(f"{value!r} is not a size: expected {SIZE_FORMS}")
    if size.denominator != 1:
        raise SizeError(f"{value!r} is not a whole number of bytes: expected {SIZE_FORMS}")
    minimum = 0 if allow_zero else 1
    if size < minimum:
        raise SizeError(f"{value!r} must be at least {minimum} byte(s): expected {SIZE_FORMS}")
    if size > MAX_SIZE:
        raise SizeError(
            f"{value!r} is larger than any file or memory size (2**63 - 1 bytes): expected "
            f"{SIZE_FORMS}"
        )
    return int(size)
