"""The one error type for bad user input. The CLI turns it into a one-line message and exit code 2."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable


class InputError(ValueError):
    """Bad input from a user: names the field and what was expected."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    choices = list(choices)
    name = str(name)
    if len(name) > MAX_NAME_CHARS:  # difflib is quadratic in the length
        return ""
    prefixed = sorted(c for c in choices if c.startswith(name) or name.startswith(c))
    if prefixed:  # 'h100' -> 'h100-sxm'; ties go to the shortest, then alphabetical ('tpu-v5' -> 'tpu-v5e')
        return f" (did you mean {min(prefixed, key=lambda c: (len(c), c))!r}?)"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown(kind: str, name: str, choices: Iterable[str]) -> InputError:
    """Error for an unknown preset name, listing near names."""
    choices = sorted(choices)
    return InputError(f"unknown {kind} {excerpt(name)}{did_you_mean(name, choices)}; expected one of: "
                      f"{', '.join(choices)}")


MAX_NAME_CHARS = 128  # model, hardware and plan names; a longer one is refused when loaded
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = 4


def excerpt(value: object, limit: int = 80) -> str:
    """A short, escaped rendering of a user's value for an error message: at most `limit` characters, two
    levels of nesting, control characters escaped (a value from a file may be huge or carry terminal escapes)."""
    text = _SHORT.repr(value) if not isinstance(value, str) else repr(value[:limit])
    text = escape(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def escape(text: str) -> str:
    """`text` with every non-printable character (line breaks, ESC, U+2028, ...) written as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown_path(path: object, limit: int = 160) -> str:
    """A file path for an error message: escaped, and shortened in the middle past `limit` characters."""
    text = escape(str(path))
    return text if len(text) <= limit else text[:limit // 2 - 2] + "..." + text[-(limit // 2 - 1):]


def check_name(value: str, where: str) -> str:
    """A name read from a file (model, hardware, plan) is data: printable characters only (no line breaks,
    control characters or terminal escapes) and at most MAX_NAME_CHARS long. Returns the name."""
    if not value.isprintable():
        raise InputError(f"{where}: expected printable characters (no line breaks or control characters), "
                         f"got {excerpt(value)}")
    if len(value) > MAX_NAME_CHARS:
        raise InputError(f"{where}: expected at most {MAX_NAME_CHARS} characters, got {len(value):,}")
    return value
