"""Quantities as a person writes them: "16 GiB", "1M tokens", "2.5": for sweep tables and plot ticks.

Three significant digits at most and never an exponent, so an axis reads "262K tokens",
not "2.62x10^5".
"""
from __future__ import annotations

import math

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ("", "K", "M", "G", "T")


def number(x: float) -> str:
    """`x` to three significant digits, trailing zeros dropped: 2, 2.5, 0.125, 1,000."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    rounded = round(x, 2 - math.floor(math.log10(abs(x))))
    text = f"{rounded:,.6f}".rstrip("0").rstrip(".")
    return text


def _scaled(x: float, base: int, units: tuple[str, ...]) -> tuple[str, str]:
    i = 0
    while i + 1 < len(units) and abs(x) >= base ** (i + 1) * 0.9995:   # 1023.9 KiB reads "1 MiB"
        i += 1
    return number(x / base ** i), units[i]


def size(nbytes: float) -> str:
    """Bytes in binary units: 17179869184 -> "16 GiB"."""
    value, unit = _scaled(nbytes, 1024, _BINARY)
    return f"{value} {unit}"


def count(n: float) -> str:
    """A count in decimal units: 1048576 -> "1.05M", 262144 -> "262K"; exact below 10,000."""
    if abs(n) < 10_000 and float(n).is_integer():
        return f"{int(n):,}"
    value, unit = _scaled(n, 1000, _DECIMAL)
    return f"{value}{unit}"


def tokens(n: float) -> str:
    return f"{count(n)} tokens"
