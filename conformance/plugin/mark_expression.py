"""Which values of the ``platform`` parameter a ``-m`` expression can select, decided before the items
are built.

pytest deselects by ``-m`` once every item exists: the family tests, parametrized over cpu, gpu and
tpu, built 23,119 items for ``pytest conformance -m cpu`` to keep 7,565, in every pytest process of a
run (each xdist worker, each rank of a job, each run a self-test starts). Here a platform value is
not generated where the expression is false for every item it could make, whatever marks the test's
other parameters add (an unknown mark is tried both ways): the same items run, fewer are built, and
the run's "deselected" count is smaller by the values never built.

The expression is read with pytest's own parser (``_pytest.mark.expression``, a private module):
where it is missing or reads the expression otherwise, every value is built, as pytest alone would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: A parsed ``-m`` expression: ``evaluate(matcher) -> bool``, ``matcher(name, **kwargs) -> bool``.
Evaluable = Any


def parsed(markexpr: str | None) -> Evaluable | None:
    """``markexpr`` parsed by pytest, or ``None`` (no expression, or one this cannot read)."""
    if not markexpr:
        return None
    try:
        from _pytest.mark.expression import Expression

        return Expression.compile(markexpr)
    except Exception:  # a private module moved, or an expression pytest itself will refuse
        return None


def can_select(expression: Evaluable, known: Mapping[str, bool]) -> bool:
    """Whether ``expression`` is true for some item whose marks are ``known`` where named there and
    anything for every other name (a mark another parameter may add): a search over the unknown
    names the expression asks about, each tried true and false."""

    def search(assigned: dict[tuple, bool]) -> bool:
        asked: list[tuple] = []

        def matcher(name: str, /, **kwargs: object) -> bool:
            if not kwargs and name in known:
                return known[name]
            key = (name, tuple(sorted(kwargs.items())))
            if key in assigned:
                return assigned[key]
            asked.append(key)
            return False

        if expression.evaluate(matcher):
            return True
        return bool(asked) and (search({**assigned, asked[0]: True}) or search({**assigned, asked[0]: False}))

    try:
        return search({})
    except Exception:  # an evaluation this cannot follow: build the value
        return True


def selectable_platforms(
    markexpr: str | None, own_marks: Iterable[str], platforms: Iterable[str]
) -> Callable[[str], bool]:
    """For a test marked ``own_marks``, whose ``platform`` parameter marks each value with its own
    name: whether ``-m markexpr`` can select an item of each platform value."""
    expression = parsed(markexpr)
    if expression is None:
        return lambda platform: True
    own = set(own_marks)
    names = tuple(platforms)

    def selectable(platform: str) -> bool:
        known = {**{name: name == platform for name in names}, **dict.fromkeys(own, True)}
        return can_select(expression, known)

    return selectable
