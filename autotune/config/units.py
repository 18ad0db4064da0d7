"""Units people type and read: byte sizes, durations, the share of memory kept free, and the
memory budget that share leaves. The one place a size is parsed or formatted."""

from __future__ import annotations

import re
from typing import overload

from autotune.errors import ConfigError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


MAX_BYTES = 2**60  # an exabyte: past it a size is a typo
# the share of a device's memory a sweep keeps free unless --headroom says otherwise
DEFAULT_HEADROOM = 0.10


@overload
def budget_bytes(capacity_bytes: int, headroom: float = ...) -> int: ...
@overload
def budget_bytes(capacity_bytes: int | None, headroom: float = ...) -> int | None: ...
def budget_bytes(capacity_bytes: int | None, headroom: float = DEFAULT_HEADROOM) -> int | None:
    """The memory a config may use under `headroom`: (1 - headroom) x the capacity (None: no
    known capacity). The one place the budget is computed."""
    return None if capacity_bytes is None else int((1.0 - headroom) * capacity_bytes)


def parse_bytes(text: str, what: str = "memory size", allow_zero: bool = False) -> int:
    """Parse '40GiB', '512MiB', '80GB' or a plain byte count into bytes (more than zero unless
    `allow_zero`: a zero-byte device or host limit would only waste a probe)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _BYTE_UNITS:
        raise ConfigError(f"{what} {text!r}: expected a size such as 40GiB, 512MiB or 80GB")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value > MAX_BYTES:
        raise ConfigError(f"{what} {text!r}: more than {MAX_BYTES // 2**50} PiB; check the unit")
    if value <= 0 and not allow_zero:
        raise ConfigError(f"{what} {text!r}: must be more than zero, e.g. 40GiB")
    return value


def parse_duration_s(text: str, what: str = "duration") -> float:
    """Parse '90', '90s', '15m', '8h' or '1d' into seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", str(text).lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{what} {text!r}: expected a positive duration such as 90s, 15m or 8h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def parse_headroom(text: str) -> float:
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"--headroom {text!r}: expected a share of memory kept free, "
                          "e.g. 10% or 0.1")
    return value


def format_bytes(num_bytes: float | None) -> str:
    """Bytes as GiB or MiB for people; the only place units are converted for display."""
    if num_bytes is None:
        return "-"
    if abs(num_bytes) >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.0f} MiB"
