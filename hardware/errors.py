"""The one error type for bad user input. The CLI turns it into a one-line message and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class InputError(ValueError):
    """Bad input from a user: names the field and what was expected."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    choices = list(choices)
    name = str(name)
    prefixed = sorted(c for c in choices if c.startswith(name) or name.startswith(c))
    if prefixed:  # 'h100' -> 'h100-sxm'; ties go to the shortest, then alphabetical ('tpu-v5' -> 'tpu-v5e')
        return f" (did you mean {min(prefixed, key=lambda c: (len(c), c))!r}?)"
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown(kind: str, name: str, choices: Iterable[str]) -> InputError:
    """Error for an unknown preset name, listing near names."""
    choices = sorted(choices)
    return InputError(f"unknown {kind} {name!r}{did_you_mean(name, choices)}; expected one of: {', '.join(choices)}")
