"""A case token, ``MESH:DIM=V,...:DTYPE:seed=S[:dma=MODE]``: what every failure's replay line carries
and ``python -m conformance replay`` takes back.

A token is read field by field, and a field that names no case the suite could make raises
``ValueError`` naming that field and what it may be: the replay command turns it into a usage error,
so that a hand-edited token is never run and its kernel never blamed for the input. What it holds:

- the mesh, a label :func:`~conformance.fixtures.meshes.parse_mesh` reads;
- each of the family's dims once, an integer of at least 1 (0 where the family's draws include 0): a
  dim given twice, a dim the family lacks, one it needs and a value that is not an integer are each
  named;
- a dtype of the family's;
- ``seed=S``, a non-negative integer (numpy's seeds);
- optionally ``dma=MODE``, one of TPU interpret mode's DMA orders.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from conformance.fixtures.meshes import MeshConfig, parse_mesh

if TYPE_CHECKING:
    from conformance.specs.base import FamilySpec

#: The token's form, as every message about a bad one quotes it.
FORM = "MESH:DIM=V,...:DTYPE:seed=S[:dma=MODE]"
#: TPU interpret mode's DMA orders (``dma_execution_mode``): as issued, and each at its wait.
DMA_MODES = ("eager", "on_wait")


@dataclasses.dataclass(frozen=True)
class CaseToken:
    """The fields of a token, each checked against its family's spec."""

    mesh: MeshConfig
    dims: dict[str, int]
    dtype: str
    seed: int
    dma_mode: str | None


def parse(token: str, spec: FamilySpec) -> CaseToken:
    """``token`` read against family ``spec`` (a :class:`~conformance.specs.base.FamilySpec`); a
    ``ValueError`` naming the first bad field and what it may be."""

    def bad(why: str) -> ValueError:
        return ValueError(f"bad case token {token!r}: {why}")

    fields = token.split(":")
    if len(fields) not in (4, 5):
        raise ValueError(f"bad case token {token!r}; expected {FORM} ({len(fields)} fields separated by ':')")
    mesh_label, dims_text, dtype, seed_text, *rest = fields
    try:
        mesh = parse_mesh(mesh_label)
    except ValueError as e:
        raise bad(str(e)) from None
    dims = _dims(dims_text, spec, bad)
    if dtype not in spec.dtypes:
        known = ", ".join(spec.dtypes)
        raise bad(f"dtype {dtype!r}{_close(dtype, spec.dtypes)} is not one of {spec.name}'s: {known}")
    if not seed_text.startswith("seed="):
        raise bad(f"{seed_text!r} where seed=S belongs; expected {FORM}")
    seed = _integer("seed", seed_text.removeprefix("seed="), bad)
    if seed < 0:
        raise bad(f"seed={seed}: a seed is a non-negative integer")
    dma_mode = None
    if rest:
        if not rest[0].startswith("dma="):
            raise bad(f"{rest[0]!r} where dma=MODE belongs; expected {FORM}")
        dma_mode = rest[0].removeprefix("dma=")
        if dma_mode not in DMA_MODES:
            raise bad(f"dma={dma_mode}{_close(dma_mode, DMA_MODES)} is not one of {', '.join(DMA_MODES)}")
    return CaseToken(mesh, dims, dtype, seed, dma_mode)


def check_choices(read: CaseToken, spec: FamilySpec, *, impl: str, token: str) -> None:
    """A dim the spec reads as a choice is the user's to get right: each operand the spec lays out from
    the dims (a ragged all-to-all's routing) is laid out here, before any kernel is blamed for it, and a
    routing, a kind of traffic rather than a size, is one of those ``impl`` is drawn."""
    for op in spec.operands:
        if op.values is not None:
            try:
                op.values(read.dims, read.mesh.axis_size)
            except ValueError as e:
                raise ValueError(f"bad case token {token!r}: {e}") from None
    routing = read.dims.get("routing")
    drawn = spec.values_of("routing") if routing is not None else ()
    if drawn and routing not in drawn:
        needs = "replicas=conformance.ExpertReplicas(...)" if "replicas" in spec.registration_options else ""
        raise ValueError(
            f"bad case token {token!r}: routing={routing} is not one of those {impl} is given "
            f"({', '.join(map(str, drawn))})" + (f"; a replicated placement needs {needs}" if needs else "")
        )


def _dims(text: str, spec: FamilySpec, bad: Callable[[str], ValueError]) -> dict[str, int]:
    dims: dict[str, int] = {}
    known = f"{spec.name}'s dims are {', '.join(spec.dims)}"
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise bad(f"dim {item!r} is not NAME=VALUE; {known}")
        if name not in spec.dims:
            raise bad(f"unknown dim {name!r}{_close(name, spec.dims)}; {known}")
        if name in dims:
            raise bad(f"dim {name} given twice")
        number = _integer(name, value, bad)
        lowest = 0 if 0 in spec.values_of(name) else 1
        if number < lowest:
            drawn = ", ".join(map(str, spec.values_of(name)))
            raise bad(f"{name}={number}: {spec.name}'s {name} is at least {lowest} (its draws: {drawn})")
        dims[name] = number
    missing = [d for d in spec.dims if d not in dims]
    if missing:
        raise bad(f"missing dim{'s' * (len(missing) > 1)} {', '.join(missing)}; {known}")
    return dims


def _integer(name: str, text: str, bad: Callable[[str], ValueError]) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad(f"{name}={text!r} is not an integer") from None


def _close(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
