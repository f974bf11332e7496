"""A user's mistake as one line, and the type checks shared by every place that reads input.

Every error a user can cause (a flag, a sweep file, a run folder) is an :class:`InputError`
whose message names the field, the value and what is allowed; the CLI prints it as one line and
exits 2, before anything launches. Python's ``bool`` is a subclass of ``int``, so the checks
below reject ``True``/``False`` where a number is meant (``iters = true`` is a mistake, not 1).
"""

from __future__ import annotations

import math


class InputError(ValueError):
    """A bad flag, file or field; the message is one line: field, value, what is allowed."""


def invalid(field: str, value: object, allowed: str) -> InputError:
    """The standard one-line error: ``field=value is invalid: allowed ...``."""
    return InputError(f"{field}={value!r} is invalid: allowed {allowed}")


def require(cond: bool, field: str, value: object, allowed: str) -> None:
    """Raise :func:`invalid` unless ``cond``."""
    if not cond:
        raise invalid(field, value, allowed)


def is_int(v: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    """A finite int or float that is not a bool (no inf, no NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def one_line(text: str, limit: int = 200) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters (for wrapped errors)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."
