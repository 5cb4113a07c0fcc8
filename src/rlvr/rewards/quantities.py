r"""Numbers with units, and when two of them are equal (the number step of rewards/equivalence.py).

A quantity is an optional sign, a number and an optional percent sign and unit, written the
canonical way (equivalence.canonical has removed thousands separators, currency signs and
wrappers): ``12``, ``-0.5``, ``.5``, ``3/4``, ``\frac{3}{4}``, ``1.5e3``, ``1.5 \times 10^{3}``,
``50%``, ``28 percent``, ``12 cm``, ``15 cm^2``, ``90 °``, ``1 234``, and ``1,22`` (a decimal
comma, only against a number written with a point).

Two quantities are equal when their units agree (or either has none) and their values do:
exactly when both terminate as decimals, within a relative 1e-6 when a decimal stands for a value
that does not terminate, with a percentage p also matching p/100.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_NUMBER_CHARS = 200  # longer answers are not read as numbers
REL_TOL = Fraction(1, 10**6)

_DIGITS = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DECIMAL = rf"(?:{_DIGITS}(?:[eE][+-]?\d{{1,3}})?|\d+,\d+|\d{{1,3}}(?: \d{{3}})+(?:\.\d+)?)"
_QUANTITY = re.compile(
    rf"(?P<sign>[+-]?)\s*(?:\\frac\{{(?P<fnum>[+-]?{_DIGITS})\}}\{{(?P<fden>[+-]?{_DIGITS})\}}"
    rf"|(?P<num>{_DECIMAL})(?:\s*/\s*(?P<den>{_DIGITS}))?)"
    r"(?:\s*(?:\\times|\\cdot|\*)\s*10\^(?:\{(?P<exp>[+-]?\d{1,3})\}|(?P<exp1>[+-]?\d)))?"
    r"\s*(?P<percent>%|percent(?:age)?|pct)?"
    r"(?:\s*(?P<unit>°|[A-Za-z]+(?:\^\{?[23]\}?)?(?:\s*(?:/|per)?\s*[A-Za-z]+(?:\^\{?[23]\}?)?){0,3}))?"
)
_UNIT_ALIASES = {
    "cm": ("cm", "centimeter", "centimetre"), "m": ("m", "meter", "metre"), "km": ("km", "kilometer", "kilometre"),
    "mm": ("mm", "millimeter", "millimetre"), "in": ("in", "inch", "inche"), "ft": ("ft", "foot", "feet"),
    "yd": ("yd", "yard"), "mi": ("mi", "mile"), "g": ("g", "gram", "gramme"), "kg": ("kg", "kilogram", "kilo"),
    "mg": ("mg", "milligram"), "lb": ("lb", "lbs", "pound"), "oz": ("oz", "ounce"), "t": ("ton", "tonne"),
    "s": ("s", "sec", "second"), "min": ("min", "minute"), "h": ("h", "hr", "hour"), "day": ("day",),
    "week": ("wk", "week"), "month": ("month",), "year": ("yr", "year"), "l": ("l", "liter", "litre"),
    "ml": ("ml", "milliliter", "millilitre"), "dollar": ("dollar", "usd", "buck"), "cent": ("cent", "¢"),
    "°": ("°", "deg", "degree"), "rad": ("rad", "radian"), "mph": ("mph",), "km/h": ("kph", "kmh"),
    "unit": ("unit",), "euro": ("eur", "euro"), "yuan": ("yuan", "rmb"),
}
_UNITS = {alias: unit for unit, aliases in _UNIT_ALIASES.items() for alias in aliases}
_NOT_UNITS = {"and", "or", "pi", "sin", "cos", "tan", "sec", "csc", "cot", "log", "ln", "exp", "lim", "sqrt", "mod",
              "gcd", "lcm", "max", "min", "inf", "sup", "det", "arg", "i", "e", "x", "y", "z", "n", "k", "a", "b", "c"}
_UNIT_WORD = re.compile(r"([A-Za-z]+)(?:\^\{?([23])\}?)?")


@dataclass(frozen=True)
class Quantity:
    value: Fraction
    percent: bool
    unit: str | None  # canonical name, or None
    decimal: bool  # written with a decimal point / comma or an exponent: an approximation of what it may stand for


def quantity(answer: str, other: str = "") -> Quantity | None:
    """A number with an optional unit, or None.  `other` (the answer on the other side) decides
    whether ``1,22`` is the decimal 1.22: only when `other` is written with a decimal point."""
    if len(answer) > MAX_NUMBER_CHARS:
        return None
    match = _QUANTITY.fullmatch(answer)
    if match is None:
        return None
    num, den = match["num"] or match["fnum"], match["den"] or match["fden"] or "1"
    if "," in num and "." not in other:
        return None  # `1,22` against a list or an integer: not a decimal comma
    unit = unit_name(match["unit"]) if match["unit"] else None
    if match["unit"] and unit is None:
        return None
    try:
        value = Fraction(num.replace(",", ".").replace(" ", "")) / Fraction(den)
    except (ValueError, ZeroDivisionError):  # a zero denominator, or > 4300 digits
        return None
    exp = match["exp"] or match["exp1"]
    if exp is not None:
        value *= Fraction(10) ** int(exp)
    decimal = bool(re.search(r"[.,eE]", num)) or exp is not None
    return Quantity(-value if match["sign"] == "-" else value, bool(match["percent"]), unit, decimal)


def unit_name(text: str) -> str | None:
    """A unit's canonical spelling (``square centimeters`` -> ``cm^2``); None if `text` is not a unit."""
    words = re.findall(r"[A-Za-z]+(?:\^\{?[23]\}?)?|°|/", text.replace(" per ", " / "))
    power, out = "", []
    for word in words:
        if word == "/":
            out.append("/")
            continue
        if word.lower() in ("square", "sq", "cubic", "cu"):
            power = "^2" if word.lower() in ("square", "sq") else "^3"
            continue
        match = _UNIT_WORD.fullmatch(word)
        name = word if match is None else match.group(1)
        known = _UNITS.get(name) or _UNITS.get(name.lower()) or _UNITS.get(_singular(name.lower()))
        if known is None and (len(name) < 3 or name.lower() in _NOT_UNITS):
            return None
        exponent = f"^{match.group(2)}" if match and match.group(2) else power
        out.append((known or _singular(name.lower())) + exponent)
        power = ""
    return "".join(out) or None


def _singular(word: str) -> str:
    if len(word) > 3 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith(("ches", "shes", "xes")):
        return word[:-2]
    if len(word) > 2 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _terminates(value: Fraction) -> bool:
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def numbers_equal(a: Quantity, b: Quantity) -> bool:
    """The number step's verdict for two quantities (see the module docstring)."""
    if a.unit and b.unit and a.unit != b.unit:
        return False
    pairs = [(a.value, b.value)]
    if a.percent:
        pairs.append((a.value / 100, b.value))
    if b.percent:
        pairs.append((a.value, b.value / 100))
    return any(_values_equal(x, y, a.decimal, b.decimal) for x, y in pairs)


def _values_equal(x: Fraction, y: Fraction, x_decimal: bool, y_decimal: bool) -> bool:
    if x == y:
        return True
    # A decimal may stand for a value it cannot write exactly (0.333333 for 1/3); never for a terminating one.
    if (x_decimal and not _terminates(y)) or (y_decimal and not _terminates(x)):
        return abs(x - y) <= REL_TOL * max(abs(x), abs(y))
    return False
