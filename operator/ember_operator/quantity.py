"""Kubernetes resource quantities as k8s.io/apimachinery's `resource.Quantity` reads and writes them.

`parse` gives a quantity's exact value; `canonical` the string kube-apiserver stores and returns for it
(`Quantity.String()` after decoding): `1000m` → `1`, `1024Mi` → `1Gi`, `0.5` → `500m`, `2000` → `2k`, a
JSON number → a string. A real API server returns requests and limits in that form, whatever was sent.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal
from typing import Any

# resource.Quantity's own error for a string it cannot parse (ErrFormatWrong).
QUANTITY_FORMAT = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
FORMAT_MESSAGE = f"quantities must match the regular expression '{QUANTITY_FORMAT}'"

_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE]?)"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_NANO = Decimal("1e-9")


def _parts(value: Any) -> tuple[Decimal, str]:
    """(exact value, format: "DecimalSI", "BinarySI" or "DecimalExponent"); ValueError when malformed."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(FORMAT_MESSAGE)
    match = _QUANTITY.fullmatch(str(value).strip() if isinstance(value, str) else repr(value))
    if match is None:
        raise ValueError(FORMAT_MESSAGE)
    number, suffix = Decimal(match.group(1)), match.group(2)
    if suffix in _BINARY:
        return number * 1024 ** _BINARY[suffix], "BinarySI"
    if suffix[:1] in ("e", "E"):
        return number.scaleb(int(suffix[1:])), "DecimalExponent"
    return number.scaleb(_DECIMAL[suffix]), "DecimalSI"


def parse(value: Any) -> Decimal:
    """A quantity's value ("500m", "64Gi", "1e3", 2), rounded up to nanos as ParseQuantity rounds."""
    return _parts(value)[0].quantize(_NANO, rounding=ROUND_CEILING)


def canonical(value: Any) -> str:
    """The quantity as kube-apiserver writes it back (`Quantity.CanonicalizeBytes`)."""
    exact, form = _parts(value)
    number = exact.quantize(_NANO, rounding=ROUND_CEILING)
    if number == 0:
        return "0"
    if form == "BinarySI" and abs(number) >= 1024 and number == number.to_integral_value():
        mantissa, exponent = int(number), 0
        while mantissa % 1024 == 0 and exponent < 6:
            mantissa, exponent = mantissa // 1024, exponent + 1
        suffix = next((s for s, e in _BINARY.items() if e == exponent), "")
        return f"{mantissa}{suffix}"
    # Decimal forms (and binary ones below 1024 or with a fraction): an integer mantissa with the largest
    # exponent, a multiple of 3, that keeps it whole.
    exponent = -9
    mantissa = int(number.scaleb(9))
    while mantissa % 1000 == 0 and exponent < 18:
        mantissa, exponent = mantissa // 1000, exponent + 3
    if form == "DecimalExponent":
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
