"""The JSON value count made from a body's bytes (``services/proxy/json_budget.py``) against the values a JSON
reader builds: over a budget exactly when the document is, whatever its strings hold (commas, brackets, quotes and
backslashes escaped every way), exact on the slow path and never under the true count on the quick one."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from services.proxy.json_budget import json_values

tricky = st.lists(st.sampled_from([*'ab ,:[]{}"\\/\n\t\u00e9\u2028', "\\\\", '\\"']), max_size=12).map(
    "".join
)
documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | tricky,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(tricky, inner, max_size=5),
    max_leaves=40,
)


def reference(value: Any) -> int:
    """Values and keys, with an empty array or object counted twice: the measure the module documents."""
    if isinstance(value, list):
        return 1 + sum(reference(v) for v in value) + (not value)
    if isinstance(value, dict):
        return 1 + sum(1 + reference(v) for v in value.values()) + (not value)
    return 1


@settings(max_examples=400, deadline=None)
@given(document=documents, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_a_body_is_over_the_budget_exactly_when_it_holds_more_values(
    document: Any, ascii_only: bool, indent: int | None
) -> None:
    raw = json.dumps(document, ensure_ascii=ascii_only, indent=indent).encode()
    true = reference(document)
    for budget in (0, true - 1, true, true + 1, 10**9):
        assert (json_values(raw, budget) > budget) == (true > budget), budget
    assert json_values(raw, 10**9) >= true  # the quick bound
    if raw.count(b'"') // 2 < true:  # the exact path, unless the strings alone are over the budget
        assert json_values(raw, true - 1) == true


def test_the_attack_bodies_are_counted_without_decoding() -> None:
    lists = b'{"messages":[],"metadata":[' + b"[]," * 1000 + b"[]]}"
    strings = b'{"messages":[],"metadata":[' + b'"",' * 1000 + b'""]}'
    assert json_values(lists, 100) > 100 and json_values(strings, 100) > 100
    text = json.dumps({"messages": [{"role": "user", "content": "1,2,3,[4]:{5}," * 10_000}]}).encode()
    assert json_values(text, 100) == reference(json.loads(text)) == 8  # commas in a string count for nothing
