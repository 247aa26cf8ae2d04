"""StableHLO (what a module lowered for another backend is): its collectives, replica groups over
``sdy`` meshes, and loop multiplicity."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import numpy as np

from conformance.hlo.model import CollectiveOp, CollectiveSummary, Shape, _unknown
from conformance.hlo.replica_groups import Groups, _ints, _participants, _rows, mesh_axes_groups

_STABLEHLO_OP = re.compile(
    r"(?P<result>%[\w#:]+(?:\s*,\s*%[\w#:]+)*)\s*=\s*\"?stablehlo\."
    r"(?P<op>all_gather|all_reduce|reduce_scatter|all_to_all|collective_permute|collective_broadcast)\b"
)
#: XLA's ragged all-to-all, which JAX lowers as a custom call (no StableHLO op of its own), in the one
#: form JAX 0.6.2 to 0.12 print: ``%r = stablehlo.custom_call @ragged_all_to_all(%a, ...) {api_version
#: = 4 : i32, backend_config = {channel_id = 1 : i64, replica_groups = dense<...> : tensor<..>}} :
#: (types) -> type``.
_RAGGED_CALL = re.compile(
    r"(?P<result>%[\w#:]+)\s*=\s*stablehlo\.custom_call\s+@ragged_all_to_all\((?P<operands>[^)]*)\)\s*"
)
_STABLEHLO_TYPE = re.compile(r"tensor<(?P<dims>(?:\d+x)*)(?P<dtype>[a-z][a-z0-9]*)>")
_MLIR_TO_HLO_DTYPE = {
    "f32": "f32",
    "f16": "f16",
    "bf16": "bf16",
    "f64": "f64",
    "i32": "s32",
    "i8": "s8",
    "i16": "s16",
    "i64": "s64",
    "ui32": "u32",
    "ui8": "u8",
    "i1": "pred",
    "f8E4M3FN": "f8e4m3fn",
}


_SDY_MESH = re.compile(r"sdy\.mesh\s+@(?P<name>[\w.$\-]+)\s*=\s*<\[(?P<axes>[^\]]*)\](?P<rest>[^>]*)>")
_STABLEHLO_MESH_GROUPS = re.compile(
    r"#stablehlo\.replica_group_mesh_axes<\s*mesh\s*=\s*(?P<mesh>.*?),\s*axes\s*=\s*\[(?P<axes>.*)\]\s*>"
)
_MLIR_MODULE_COUNT = re.compile(r"mhlo\.(?P<key>num_partitions|num_replicas)\s*=\s*(?P<n>\d+)")


def _closing(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the ``close`` that balances the ``open_`` at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise _unknown("an unbalanced op", text[i : i + 200])


def _dense_ints(text: str, what: str) -> np.ndarray:
    """A ``dense<...> : tensor<AxBxi64>`` integer attribute (list, splat or empty) as an array."""
    m = re.fullmatch(r"dense<(?P<value>[^>]*)>\s*:\s*tensor<(?P<shape>(?:\d+x)*)i\d+>", text.strip())
    if not m:
        raise _unknown(what, text)
    shape = tuple(int(d) for d in m["shape"].split("x") if d)
    value = m["value"].strip()
    if re.fullmatch(r"-?\d+", value):  # a splat: every element the same
        return np.full(shape, int(value))
    data = np.array(json.loads(value or "[]"), dtype=np.int64)
    if data.size != math.prod(shape):
        raise _unknown(what, text)
    return data.reshape(shape)


def _stablehlo_mesh_groups(text: str, meshes: dict[str, str]) -> Groups:
    """``#stablehlo.replica_group_mesh_axes<mesh = @m | #stablehlo.mesh<...>, axes = [...]>``."""
    m = _STABLEHLO_MESH_GROUPS.fullmatch(text.strip())
    if not m:
        raise _unknown("the StableHLO mesh-axes replica groups", text)
    mesh_text = m["mesh"].strip()
    ids = None
    if mesh_text.startswith("@"):
        if mesh_text[1:] not in meshes:
            raise _unknown("the StableHLO mesh-axes replica groups (no sdy.mesh of that name)", text)
        decl = _SDY_MESH.fullmatch(meshes[mesh_text[1:]])
        assert decl is not None  # meshes holds only lines _SDY_MESH matched
        axes = [
            (a["name"], int(a["size"]))
            for a in re.finditer(r'"(?P<name>[^"]+)"\s*=\s*(?P<size>\d+)', decl["axes"])
        ]
        rest = decl["rest"].strip()
        if rest:
            listed = re.fullmatch(r",\s*device_ids\s*=\s*\[(?P<ids>[0-9,\s]*)\]", rest)
            if not listed:
                raise _unknown("the sdy.mesh", meshes[mesh_text[1:]])
            ids = np.array(_ints(listed["ids"]))
    elif mesh_text.startswith("#stablehlo.mesh<"):
        axes = [
            (a["name"], int(a["size"]))
            for a in re.finditer(
                r'#stablehlo\.mesh_axis<\s*name\s*=\s*"(?P<name>[^"]+)"\s*,\s*size\s*=\s*(?P<size>\d+)\s*>',
                mesh_text,
            )
        ]
        if not axes or "device_ids" in mesh_text:
            raise _unknown("the StableHLO mesh", mesh_text)
    else:
        raise _unknown("the StableHLO mesh-axes replica groups (mesh)", text)
    grouped: list[tuple[str, tuple[int, int] | None]] = []
    for ref in re.split(r",\s*(?=[\"#])", m["axes"].strip()) if m["axes"].strip() else ():
        named = re.fullmatch(
            r'"(?P<name>[^"]+)"|#stablehlo\.axis_ref<\s*name\s*=\s*"(?P<ref>[^"]+)"\s*>', ref.strip()
        )
        if not named:  # e.g. a sub-axis, whose StableHLO spelling no supported JAX has printed
            raise _unknown("the StableHLO axis reference", ref)
        grouped.append((named["name"] or named["ref"], None))
    try:
        return mesh_axes_groups(axes, grouped, ids)
    except ValueError as e:
        raise _unknown(f"the StableHLO mesh-axes replica groups ({e})", text) from e


def _stablehlo_attributes(body: str) -> dict[str, str]:
    """``key = value`` pairs of an attribute dictionary's body (values with brackets balanced)."""
    out, depth, key_start, i = {}, 0, 0, 0
    for i, ch in enumerate(body + ","):
        if ch in "<[({":
            depth += 1
        elif ch in ">])}" and not (ch == ">" and body[i - 1 : i] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            item = body[key_start:i].strip()
            key, _, value = item.partition("=")
            if item:
                out[key.strip()] = value.strip()
            key_start = i + 1
    return out


_FUNC = re.compile(r"^  func\.func\b[^@\n]*@(?P<name>[\w.$\-]+)\(", re.M)
_CALL = re.compile(r"\b(?:func\.)?call @(?P<name>[\w.$\-]+)\(")
_WHILE = re.compile(r"\bstablehlo\.while\b")


def _stablehlo_multiplicity(text: str) -> Callable[[int], int | None]:
    """How many times an op at a position in the module runs per call of ``@main``.

    Functions are the top-level ``func.func`` blocks (two-space indent, closed by a line
    ``  }``); a private one runs once per ``call`` of it, times its caller's count. An op
    inside a ``stablehlo.while`` body runs an unknown number of times: ``None``. Branches
    of a ``stablehlo.case`` count once each, as in :func:`parse_hlo`.
    """
    funcs: dict[str, tuple[int, int]] = {}
    for m in _FUNC.finditer(text):
        end = text.find("\n  }\n", m.end())
        if end < 0:
            line = text[m.start() : text.find("\n", m.start())]
            raise _unknown("a func.func with no closing line '  }'", line)
        funcs[m["name"]] = (m.start(), end)
    loops = []  # (start, end, trip count or None)
    for m in _WHILE.finditer(text):
        body = text.find(" do {", m.end())
        if body < 0:
            raise _unknown("a stablehlo.while with no 'do {' body", text[m.start() : m.start() + 200])
        end = _closing(text, body + 4, "{", "}")
        loops.append((m.start(), end, _stablehlo_trip_count(text, m.start(), body, end)))

    def enclosing(pos: int) -> str | None:
        return next((name for name, (a, b) in funcs.items() if a <= pos < b), None)

    def loop_factor(pos: int) -> int | None:
        """Product of the trip counts of the loops around ``pos`` (``None`` if one is unknown)."""
        factor: int | None = 1
        for a, b, trips in loops:
            if a <= pos < b:
                factor = None if factor is None or trips is None else factor * trips
        return factor

    def scaled(count: int | None, factor: int | None) -> int | None:
        return None if count is None or factor is None else count * factor

    calls: dict[str, list[int]] = {}
    for m in _CALL.finditer(text):
        calls.setdefault(m["name"], []).append(m.start())
    memo: dict[str, int | None] = {}

    def times(func: str | None, seen: frozenset[str] = frozenset()) -> int | None:
        if func is None or func == "main":
            return 1
        if func in seen:
            raise _unknown(f"a recursive call of @{func}", func)
        if func not in memo:
            total: int | None = 0
            for pos in calls.get(func, ()):
                caller = scaled(times(enclosing(pos), seen | {func}), loop_factor(pos))
                total = None if caller is None or total is None else total + caller
            memo[func] = total
        return memo[func]

    return lambda pos: scaled(times(enclosing(pos)), loop_factor(pos))


_WHILE_HEADER = re.compile(r"stablehlo\.while\((?P<args>[^)]*)\)")
_CONSTANT_DEF = r"{name}\s*=\s*stablehlo\.constant dense<(?P<value>-?\d+)>\s*:\s*tensor<[a-z]*\d+>"


def _stablehlo_trip_count(text: str, start: int, body: int, end: int) -> int | None:
    """Trips of a ``stablehlo.while`` in the counted form JAX lowers ``fori_loop`` and ``scan`` to.

    The condition is ``compare LT, %i, %N`` on one loop variable; ``%i`` starts at a constant and
    the body returns ``%i + step`` for a constant step in its place. Any other loop is one whose
    trips this parser cannot know: ``None``, which byte accounting reports as unbounded.
    """
    header = _WHILE_HEADER.match(text, start)
    if not header:
        return None
    args = [a.split("=") for a in header["args"].split(",")]
    if any(len(a) != 2 for a in args):
        return None
    names, inits = [a[0].strip() for a in args], [a[1].strip() for a in args]
    cond = text[start:body]
    compare = re.search(r"stablehlo\.compare\s+LT,\s*(?P<i>%[\w#]+),\s*(?P<n>%[\w#]+)", cond)
    if not compare or compare["i"] not in names:
        return None
    k = names.index(compare["i"])

    def constant(name: str, before: int) -> int | None:
        found = list(re.finditer(_CONSTANT_DEF.format(name=re.escape(name)), text[:before]))
        return int(found[-1]["value"]) if found else None  # the nearest definition before its use

    bound, first = constant(compare["n"], compare.end() + start), constant(inits[k], start)
    returned = re.findall(r"stablehlo\.return\s+([^:]*):", text[body:end])
    if bound is None or first is None or not returned:
        return None
    results = [r.strip() for r in returned[-1].split(",")]
    if len(results) != len(names):
        return None
    step_def = re.search(
        re.escape(results[k]) + r"\s*=\s*stablehlo\.add\s+" + re.escape(names[k]) + r",\s*(?P<c>%[\w#]+)",
        text[body:end],
    )
    step = constant(step_def["c"], body + step_def.end()) if step_def else None
    if not step or step <= 0:
        return None
    return max(0, -(-(bound - first) // step))


def parse_stablehlo(text: str) -> CollectiveSummary:
    """Collectives in a lowered (not yet compiled) StableHLO module, e.g. one lowered for TPU.

    Each op is read in JAX's generic form, ``"stablehlo.x"(operands) <{attrs}>
    ({region})? : (types) -> types``, its attributes from its own dictionary
    only. Its multiplicity comes from the call graph of the module's functions
    (``None`` inside a ``stablehlo.while``); the types are the target's own, so a
    bfloat16 transfer counts 2 bytes an element here, where XLA CPU's compiled
    module converts it to float32 first.
    """
    multiplicity = _stablehlo_multiplicity(text)
    meshes = {m["name"]: m[0] for m in _SDY_MESH.finditer(text)}
    counts = {"num_replicas": 1, "num_partitions": 1}
    header = re.search(r"^\s*module\b.*$", text, re.M)
    if header:
        counts.update((m["key"], int(m["n"])) for m in _MLIR_MODULE_COUNT.finditer(header[0]))
    ops = []
    for m in _STABLEHLO_OP.finditer(text):
        kind = m["op"].replace("_", "-")
        line = text[m.start() : text.find("\n", m.start())]
        call = re.compile(r'"?\s*\((?P<operands>[^)]*)\)\s*').match(text, m.end())
        if not call or not text.startswith("<{", call.end()):
            raise _unknown(
                f"the StableHLO {kind} (not in the generic form with an attribute dictionary)", line
            )
        attrs_end = _closing(text, call.end() + 1, "{", "}")
        attrs = _stablehlo_attributes(text[call.end() + 2 : attrs_end - 1])
        after = attrs_end + 1
        region = re.compile(r"\s*\(\{").match(text, after)
        if region:
            after = _closing(text, region.end() - 2, "(", ")")
        sig = re.compile(r"\s*:\s*\((?P<ins>[^)]*)\)\s*->").match(text, after)
        if not sig:
            raise _unknown(f"the StableHLO {kind} (no function type after it)", line)
        shapes_in = tuple(
            Shape(
                _MLIR_TO_HLO_DTYPE.get(t["dtype"], t["dtype"]),
                tuple(int(d) for d in t["dims"].split("x") if d),
            )
            for t in _STABLEHLO_TYPE.finditer(sig["ins"])
        )
        pairs, groups = None, None
        if kind == "collective-permute":
            if "source_target_pairs" not in attrs:
                raise _unknown("a StableHLO collective_permute without source_target_pairs", line)
            array = _dense_ints(attrs["source_target_pairs"], "the StableHLO source_target_pairs")
            if array.size and (array.ndim != 2 or array.shape[1] != 2):
                raise _unknown("the StableHLO source_target_pairs (not pairs)", attrs["source_target_pairs"])
            pairs = tuple((int(a), int(b)) for a, b in array.reshape(-1, 2))
        else:
            value = attrs.get("replica_groups")
            if value is None:
                raise _unknown(f"a StableHLO {kind} without replica_groups", line)
            if value.startswith("dense<"):
                array = _dense_ints(value, "the StableHLO replica_groups")
                parsed = _rows(array, array.shape[-1]) if array.size else ()
            else:
                parsed = _stablehlo_mesh_groups(value, meshes)
            groups = _participants(
                parsed,
                kind=kind,
                has_channel="channel_handle" in attrs,
                global_ids="use_global_device_ids" in attrs,
                replicas=counts["num_replicas"],
                partitions=counts["num_partitions"],
                text=value,
            )
        ops.append(
            CollectiveOp(
                kind=kind,
                phase="sync",
                name=m["result"].split(",")[0].strip(),
                computation="",
                operand_shapes=shapes_in,
                result_shapes=(),
                source_target_pairs=pairs,
                replica_groups=groups,
                multiplicity=multiplicity(m.start()),
            )
        )
    ops.extend(_ragged_calls(text, multiplicity, counts))
    return CollectiveSummary(tuple(ops))


def _ragged_calls(
    text: str, multiplicity: Callable[[int], int | None], counts: dict[str, int]
) -> list[CollectiveOp]:
    """Each ``stablehlo.custom_call @ragged_all_to_all`` (:data:`_RAGGED_CALL`): its operand and result
    types and its replica groups (cross-partition, as its channel id makes it). A custom call of that
    target in any other form raises, quoting it."""
    ops, found = [], {m.start() for m in _RAGGED_CALL.finditer(text)}
    for m in re.finditer(r"custom_call\b[^\n]*ragged_all_to_all", text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        line = text[line_start : text.find("\n", m.start())]
        match = _RAGGED_CALL.search(line)
        if match is None or line_start + match.start() not in found:
            raise _unknown("a custom call of XLA's ragged all-to-all in a form not listed", line.strip())
        rest = line[match.end() :]
        if not rest.startswith("{"):
            raise _unknown("the ragged all-to-all custom call (no attribute dictionary)", line.strip())
        attrs_end = _closing(rest, 0, "{", "}")
        attrs = _stablehlo_attributes(rest[1 : attrs_end - 1])
        config = attrs.get("backend_config", "")
        if not (config.startswith("{") and config.endswith("}")):
            raise _unknown("the ragged all-to-all's backend_config", line.strip())
        inner = _stablehlo_attributes(config[1:-1])
        sig = re.fullmatch(r"\s*:\s*\((?P<ins>[^)]*)\)\s*->\s*(?P<out>tensor<[^>]*>)\s*", rest[attrs_end:])
        if "replica_groups" not in inner or not inner["replica_groups"].startswith("dense<") or not sig:
            raise _unknown("the ragged all-to-all custom call (replica groups or types)", line.strip())
        array = _dense_ints(inner["replica_groups"], "the ragged all-to-all's replica_groups")
        groups = _participants(
            _rows(array, array.shape[-1]) if array.size else (),
            kind="ragged-all-to-all",
            has_channel="channel_id" in inner,
            global_ids=False,
            replicas=counts["num_replicas"],
            partitions=counts["num_partitions"],
            text=inner["replica_groups"],
        )

        def shapes(types: str) -> tuple[Shape, ...]:
            return tuple(
                Shape(
                    _MLIR_TO_HLO_DTYPE.get(t["dtype"], t["dtype"]),
                    tuple(int(d) for d in t["dims"].split("x") if d),
                )
                for t in _STABLEHLO_TYPE.finditer(types)
            )

        ops.append(
            CollectiveOp(
                kind="ragged-all-to-all",
                phase="sync",
                name=match["result"],
                computation="",
                operand_shapes=shapes(sig["ins"]),
                result_shapes=shapes(sig["out"]),
                replica_groups=groups,
                multiplicity=multiplicity(line_start + match.start()),
            )
        )
    return ops
