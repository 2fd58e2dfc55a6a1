"""The kinds of value a field of a model file must hold, each with the words a message names it by:
config.json's fields and GGUF's metadata are checked against them before any value is used, so a
wrong one ends in one line naming the field instead of an exception deep inside."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from .errors import FormatError

# The largest integer a size or an id may be: far past any model, and still an int32, whatever
# kernel or table it reaches.
INT_MAX = 2**31 - 1


class Kind(NamedTuple):
    accepts: Callable[[object], bool]
    says: str   # "a positive integer"

    def check(self, where: str, value) -> None:
        """FormatError "<where> is <value>, not <what it must be>" unless `value` is of this kind."""
        if not self.accepts(value):
            raise FormatError(f"{where} is {short(value)}, not {self.says}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON's true is not a count


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(least: int = 0, most: int = INT_MAX) -> Kind:
    says = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer from {least}")
    return Kind(lambda v: _is_int(v) and least <= v <= most,
                says if most == INT_MAX else f"{says} up to {most}")


def number(above: float | None = None, least: float | None = None, most: float | None = None) -> Kind:
    """A finite number, above `above`, at least `least` and at most `most` where given."""
    says = ("a finite number" + (f" above {above:g}" if above is not None else "")
            + (f" of at least {least:g}" if least is not None else "")
            + (f" up to {most:g}" if most is not None else ""))
    return Kind(lambda v: _is_number(v) and (above is None or v > above)
                and (least is None or v >= least) and (most is None or v <= most), says)


def list_of(kind: Kind, plural: str) -> Kind:
    return Kind(lambda v: isinstance(v, list) and all(kind.accepts(x) for x in v), f"a list of {plural}")


def either(*kinds: Kind) -> Kind:
    return Kind(lambda v: any(k.accepts(v) for k in kinds), " or ".join(k.says for k in kinds))


def optional(kind: Kind) -> Kind:
    """`kind`, or null (a field left unset)."""
    return Kind(lambda v: v is None or kind.accepts(v), f"{kind.says} or null")


COUNT = integer(1)
STRING = Kind(lambda v: isinstance(v, str), "a string")
BOOL = Kind(lambda v: isinstance(v, bool), "a boolean")
OBJECT = Kind(lambda v: isinstance(v, dict), "an object")


def short(value) -> str:
    """repr(value), cut to 40 characters: the value a message names may be a whole vocabulary."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
