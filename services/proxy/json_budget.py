"""How many values a JSON body holds, told from its bytes before anything is decoded.

What a body costs the proxy is not its size but its values: 8 MiB of text decodes to one 8 MiB string, 8 MiB of
``[],`` to 2.8 million lists (170 MB of Python objects, half a second of a held GIL, issue 42). So a body is
measured first, with a few C-speed passes over its bytes and no objects made, and one over the budget is refused
undecoded.

The measure is the count of ``,``, ``[``, ``{`` and ``:`` outside strings, plus one: every value and every object
key, with an empty array or object counted twice (it has an opening bracket and no item). The characters are
counted in the raw bytes first (one ``translate`` pass, ~3 ms for 8 MiB), an upper bound that settles almost every
body; only when that bound is over the budget (text full of commas, a CSV in a tool result) are strings taken out
and the count made exact: escapes removed (``\\\\`` then ``\\"``, as a JSON reader pairs them), so that every
``"`` left delimits a string, then everything but the counted characters and quotes dropped, then the strings.
"""

from __future__ import annotations

import re

_STRUCTURE = b",[{:"
_DROP = bytes(c for c in range(256) if c not in b'",[{:')
"""Every byte that neither delimits a string nor is counted."""
_STRING = re.compile(rb'"[^"]*"')


def json_values(raw: bytes, budget: int) -> int:
    """A count of the values and keys in the JSON document ``raw`` (empty containers counted twice) that is over
    ``budget`` exactly when the true count is: the quick upper bound when it is within the budget (or exact: no
    strings), the number of strings when they alone are over it, else the exact count. For bytes that are not JSON
    the figure means little, but it never undercounts what a JSON reader builds before it finds the error."""
    bound = 1 + len(raw) - len(raw.translate(None, _STRUCTURE))  # one pass, at memory speed
    if bound <= budget:
        return bound
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    strings = plain.count(b'"') // 2  # each a value or a key: a lower bound
    if strings == 0:
        return bound  # nothing to take out: the bound is exact
    if strings > budget:
        return strings
    return 1 + len(_STRING.sub(b"", plain.translate(None, _DROP)))  # only counted characters are left
