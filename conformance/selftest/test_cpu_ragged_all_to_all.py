"""XLA's ragged all-to-all on CPU (:mod:`conformance.targets.cpu_ragged_all_to_all`): the emulation is
the op bit for bit on every routing of the family, forward and transposed, on rings of 1, 3, 4 and 8;
a process after the suite is untouched; a verdict of a check that ran it says so; and the gradient
JAX's own transpose of the op gives is named where a kernel inherits it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import conformance
from conformance import checks, compat
from conformance.fixtures.meshes import parse_mesh
from conformance.run.outcomes import run_here
from conformance.runner import Case
from conformance.session import Session
from conformance.specs import ragged_all_to_all as spec
from conformance.targets import cpu_ragged_all_to_all, tpu_compiler

pytestmark = pytest.mark.selftest


@pytest.fixture(autouse=True)
def the_emulation() -> None:
    """Asked at run time, not at collection (the probe compiles on the CPU backend)."""
    if not cpu_ragged_all_to_all.emulating():
        pytest.skip(f"nothing is emulated here: XLA:CPU runs the op ({jax.__version__})")


def _program(n: int):
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
    return jax.jit(
        jax.shard_map(
            lambda *blocks: lax.ragged_all_to_all(*blocks, axis_name="x"),
            mesh=mesh,
            in_specs=(P("x"),) * 6,
            out_specs=P("x"),
        )
    )


def _operands(kind: int, n: int, dtype: str) -> tuple[np.ndarray, ...]:
    dims = {"routing": kind, "rows_per_shard": 7, "out_rows_per_shard": 9, "cols": 3}
    routing = [a.reshape(-1).astype(np.int32) for a in spec.routing(dims, n)]
    rng = np.random.default_rng([kind, n])
    x = rng.integers(-100, 100, size=(n * 7, 3)).astype(dtype)
    output = rng.integers(-100, 100, size=(n * 9, 3)).astype(dtype)
    return (x, output, *routing)


@pytest.mark.parametrize("n", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_the_emulation_is_the_op_on_every_routing_forward_and_transposed(n: int, dtype: str) -> None:
    program = _program(n)
    for kind in range(len(spec.ROUTINGS)):
        operands = _operands(kind, n, dtype)
        got = np.asarray(program(*operands))
        want = spec.reference(*(a.astype(np.float64) for a in operands), axis_size=n)
        assert np.array_equal(got.astype(np.float64), want), (kind, n)
        cotangent = np.random.default_rng(kind).standard_normal(got.shape).astype(np.float32)
        if dtype != "float32":
            continue
        _, pullback = jax.vjp(lambda x, out, ops=operands: program(x, out, *ops[2:]), *operands[:2])
        d_x, d_output = (np.asarray(g, np.float64) for g in pullback(cotangent))
        inputs64 = tuple(a.astype(np.float64) for a in operands)
        exact = spec.vjp_reference(*inputs64, cotangent.astype(np.float64))
        # what JAX's own transpose gives: d_x exact; d_output its mask's (exact where no group of zero
        # rows meets another group's rows)
        jax_gives = [
            spec.jax_transpose_vjp(*inputs64, cotangent.astype(np.float64), axis_size=n, zeroed=zeroed)[1]
            for zeroed in ("above_zero", "not_zero")  # JAX 0.10 on, and JAX 0.6
        ]
        assert np.array_equal(d_x, exact[0]), (kind, n)
        assert any(np.array_equal(d_output, gives) for gives in jax_gives), (kind, n)


def test_after_the_suite_the_process_is_untouched() -> None:
    """The undo restores XLA:CPU's own answer; the install that the run made is back after."""
    program, operands = _program(2), _operands(0, 2, "float32")
    undo = cpu_ragged_all_to_all.install()  # installed already by the plugin: a no-op
    undo()
    assert cpu_ragged_all_to_all.emulating(), "an inner install's undo removed the run's emulation"
    rules, _, _ = compat.cpu_lowering_rules()
    ours = rules.pop(cpu_ragged_all_to_all._primitive())
    try:
        jax.clear_caches()
        with pytest.raises(Exception, match="ragged"):
            program(*operands)
        undo = cpu_ragged_all_to_all.install()
        assert np.asarray(program(*operands)).shape == (2 * 9, 3)
        undo()
        with pytest.raises(Exception, match="ragged"):
            program(*operands)
    finally:
        rules[cpu_ragged_all_to_all._primitive()] = ours
        jax.clear_caches()


def test_a_verdict_that_ran_the_op_says_so_and_one_that_did_not_does_not() -> None:
    mesh = parse_mesh("4-x-auto")
    for impl, emulated in (("xla_ragged_all_to_all", True), ("dense_ragged_all_to_all", False)):
        case = Case.make("ragged_all_to_all", impl, mesh, dict(spec.SPEC.canonical_dims), "float32")
        outcome = run_here(checks.CHECKS["values"], case, Session())
        assert outcome.verdict == "passed", outcome.message
        assert outcome.emulated == (cpu_ragged_all_to_all.LABEL if emulated else ""), impl
        lowered = run_here(checks.CHECKS["cross_lowering"], case, Session())
        assert lowered.emulated == "", "a check that only lowers for TPU and GPU ran nothing emulated"


def _users_exchange(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, mesh, axis_name):
    """A kernel of one's own on XLA's op, differentiated through JAX's transpose of it."""
    return jax.shard_map(
        lambda *blocks: lax.ragged_all_to_all(*blocks, axis_name=axis_name),
        mesh=mesh,
        in_specs=(P(axis_name),) * 6,
        out_specs=P(axis_name),
    )(x, output, input_offsets, send_sizes, output_offsets, recv_sizes)


def test_a_kernel_on_the_op_inherits_jax_transpose_named_and_the_baseline_is_not_judged() -> None:
    name = "users_exchange_on_xla_op"
    if name not in conformance.implementations("ragged_all_to_all"):
        conformance.register("ragged_all_to_all", name=name, differentiable=True)(_users_exchange)
    dims = {"rows_per_shard": 5, "out_rows_per_shard": 2, "cols": 1, "routing": 0}
    mesh = parse_mesh("3-x-explicit")  # device 0 receives a group of zero rows where another lands
    theirs = run_here(
        checks.CHECKS["gradients"], Case.make("ragged_all_to_all", name, mesh, dims, "float32"), Session()
    )
    assert theirs.verdict == "failed", theirs.message
    assert "known mistake  : the gradients are exactly what JAX's own transpose" in theirs.message
    assert theirs.emulated == cpu_ragged_all_to_all.LABEL and "emulated       : " in theirs.message
    baseline = Case.make("ragged_all_to_all", "xla_ragged_all_to_all", mesh, dims, "float32")
    said = run_here(checks.CHECKS["gradients"], baseline, Session())
    assert said.verdict == "not_judged" and "JAX's own transpose" in said.message, said.message


def test_a_kernel_on_the_op_meets_the_ops_pod_limit_not_judged_as_the_baseline_does() -> None:
    """libtpu refuses XLA's ragged all-to-all on v5e slices of 64 chips (limited ICI routing): for a
    kernel that calls the op that is the platform's limit, as for the baseline, not a failure."""
    from conformance.checks import tpu_pod
    from conformance.targets import tpu_compiler

    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    name = "users_exchange_on_xla_op"
    if name not in conformance.implementations("ragged_all_to_all"):
        conformance.register("ragged_all_to_all", name=name, differentiable=True)(_users_exchange)
    dims = dict(spec.SPEC.tpu_native_dims)
    case = Case.make("ragged_all_to_all", name, parse_mesh(tpu_pod.POD_MESHES[0]), dims, "bfloat16")
    said = run_here(checks.CHECKS["tpu_pod"], case, Session())
    assert said.verdict in ("not_judged", "passed"), said.message
    if said.verdict == "not_judged":  # a libtpu that compiles the op there passes it
        assert "the kernel calls XLA's ragged all-to-all" in said.message, said.message


def test_the_pod_probe_answers_only_a_refusal_of_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-op program that asks libtpu whether a slice takes XLA's ragged all-to-all answers for
    every kernel on the op only where the compiler's refusal names the op; any other refusal of the
    probe (its own program on some JAX) answers nothing, and each kernel is compiled and judged."""
    from conformance.targets import tpu_compiler

    if not tpu_compiler.available():
        pytest.skip(f"no TPU compiler here: {tpu_compiler.unavailable_reason()}")
    for said, answer in (
        ("INTERNAL: RET_CHECK failure ... Ragged all-to-all is currently not supported", True),
        ("INTERNAL: something else entirely", False),
    ):

        def refused(*args, said=said, **kwargs):
            raise tpu_compiler.CompilerRefusal(said)

        monkeypatch.setattr(tpu_compiler, "compile_on", refused)
        tpu_compiler.ragged_all_to_all_refusal.cache_clear()
        try:
            assert (tpu_compiler.ragged_all_to_all_refusal("v5e:2x2") == said) is answer
        finally:
            tpu_compiler.ragged_all_to_all_refusal.cache_clear()


def test_a_kernel_on_the_op_is_not_held_to_the_emulations_collectives() -> None:
    """The emulation's all-to-alls in the module compiled for CPU count as the op's groups: a MoE
    dispatch written on the op (the baseline's code under a kernel's name) passes collectives and
    backward collectives on CPU, labelled, as the baseline does."""
    from conformance import registry

    name = "users_dispatch_on_xla_op"
    if name not in conformance.implementations("moe_dispatch"):
        conformance.register("moe_dispatch", name=name, differentiable=True)(
            registry.get("moe_dispatch", "xla_moe_dispatch").fn
        )
    dims = dict(registry.spec_of("moe_dispatch", name).canonical_dims)
    case = Case.make("moe_dispatch", name, parse_mesh("8-x-auto"), dims, "float32")
    for check in ("collectives", "backward_collectives"):
        said = run_here(checks.CHECKS[check], case, Session())
        assert said.verdict == "passed", said.message
        assert said.emulated == cpu_ragged_all_to_all.LABEL, check


def _whole_shard_through_the_op(
    x, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, mesh, axis_name
):
    """Right values, too many bytes: every device's whole shard through XLA's op to every peer, each
    receiver then cutting the groups meant for it (their senders' offsets and sizes exchanged)."""

    def body(x, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        n, rows = send_sizes.shape[0], x.shape[0]
        me = lax.axis_index(axis_name)
        everything = jnp.zeros((n * rows, *x.shape[1:]), x.dtype)
        zeros, whole = jnp.zeros(n, jnp.int32), jnp.full(n, rows, jnp.int32)
        shards = lax.ragged_all_to_all(
            x,
            compat.varying(everything, axis_name),
            zeros,
            whole,
            jnp.full(n, me * rows, jnp.int32),
            whole,
            axis_name=axis_name,
        )
        start, size, at = (
            lax.all_to_all(a, axis_name, 0, 0, tiled=True)
            for a in (input_offsets, send_sizes, output_offsets)
        )
        step = jnp.arange(rows)
        source = jnp.arange(n)[:, None] * rows + start[:, None] + step
        target = jnp.where(step < size[:, None], at[:, None] + step, output.shape[0])
        return output.at[target.reshape(-1)].set(
            shards[jnp.clip(source, 0, n * rows - 1)].reshape(-1, *x.shape[1:]), mode="drop"
        )

    return jax.shard_map(body, mesh=mesh, in_specs=(P(axis_name),) * 6, out_specs=P(axis_name))(
        x, output, input_offsets, send_sizes, output_offsets, recv_sizes
    )


def test_the_ops_bytes_are_its_groups_and_a_kernel_that_ships_too_many_through_it_fails() -> None:
    """A module's text gives XLA's ragged all-to-all's buffers (or, compiled for CPU, the emulation's
    all-to-alls), not what it moves: counted in a run on CPU, the op's groups. A kernel on the op
    passes the bytes where its output buffer alone is past the bound (a ring of 2, 16 output rows for
    groups of at most 13), and its backward where the emulation's blocks are; one that moves every
    shard whole through the op fails, its count named."""
    for name, fn in (
        ("users_exchange_on_xla_op", _users_exchange),
        ("whole_shard_through_xla_op", _whole_shard_through_the_op),
    ):
        if name not in conformance.implementations("ragged_all_to_all"):
            conformance.register("ragged_all_to_all", name=name, differentiable=True)(fn)
    mesh, groups_within = parse_mesh("2-x-explicit"), {"rows_per_shard": 13, "out_rows_per_shard": 16}
    shards_past = {"rows_per_shard": 13, "out_rows_per_shard": 8}  # 13 rows a peer, where 8 can land

    def case(name: str, rows: dict[str, int], dtype: str = "bfloat16") -> Case:
        return Case.make("ragged_all_to_all", name, mesh, {**rows, "cols": 8, "routing": 0}, dtype)

    values = run_here(
        checks.CHECKS["values"], case("whole_shard_through_xla_op", shards_past, "float32"), Session()
    )
    assert values.verdict == "passed", values.message
    for check in ("collectives", "lowered_bytes", *(("tpu_bytes",) if tpu_compiler.available() else ())):
        said = run_here(checks.CHECKS[check], case("users_exchange_on_xla_op", groups_within), Session())
        assert said.verdict == "passed", said.message
        said = run_here(checks.CHECKS[check], case("whole_shard_through_xla_op", shards_past), Session())
        assert said.verdict == "failed", said.message
        assert "counted as the op moves them: 208 bytes of its groups' rows" in said.message, said.message
    # the transposed exchange: JAX's transpose sends its offsets, the op its groups (where the
    # emulation's padded blocks and its own offsets were past the bound)
    ring = Case.make(
        "ragged_all_to_all",
        "users_exchange_on_xla_op",
        parse_mesh("8-x-auto"),
        dict(spec.SPEC.canonical_dims),
        "float32",
    )
    said = run_here(checks.CHECKS["backward_collectives"], ring, Session())
    assert said.verdict == "passed", said.message


def test_a_kernel_declared_for_tpu_and_gpu_gets_every_check_that_only_lowers_or_compiles() -> None:
    """Registered ``platforms=("tpu", "gpu")``, as a kernel on XLA's op was before CPU could run it: on a
    CPU host it is not claimed for what runs there (output sharding), and claimed for what only lowers or
    compiles (cross-lowering, the lowered bytes, the TPU bytes), which pass, the op's groups counted."""
    from conformance import family_tests, registry
    from conformance.claims import NotClaimed

    name = "users_dispatch_for_tpu_and_gpu"
    if name not in conformance.implementations("moe_dispatch"):
        conformance.register("moe_dispatch", name=name, differentiable=True, platforms=("tpu", "gpu"))(
            registry.get("moe_dispatch", "xla_moe_dispatch").fn
        )
    mesh = parse_mesh("8-x-auto")
    with pytest.raises(NotClaimed, match="platform cpu"):
        family_tests.case_for(
            checks.CHECKS["output_sharding"].axes, "moe_dispatch", name, {"mesh_config": mesh}
        )
    judged = [("cross_lowering", mesh, "float32"), ("lowered_bytes", mesh, "bfloat16")]
    if tpu_compiler.available():
        judged.append(("tpu_bytes", parse_mesh("8-x-explicit"), "bfloat16"))
    for check, on, dtype in judged:
        params = {"platform": "cpu", "mesh_config": on, "dtype": dtype}
        case = family_tests.case_for(checks.CHECKS[check].axes, "moe_dispatch", name, params)
        said = run_here(checks.CHECKS[check], case, Session())
        assert said.verdict == "passed", said.message


def test_without_the_emulation_xla_cpus_refusal_is_the_platforms_limit_not_the_kernels() -> None:
    rules, _, _ = compat.cpu_lowering_rules()
    ours = rules.pop(cpu_ragged_all_to_all._primitive())
    try:
        jax.clear_caches()
        dims = {"rows_per_shard": 5, "out_rows_per_shard": 16, "cols": 1, "routing": 3}  # run nowhere else
        case = Case.make("ragged_all_to_all", "xla_ragged_all_to_all", parse_mesh("2-x-auto"), dims, "int8")
        said = run_here(checks.CHECKS["values"], case, Session())
        assert said.verdict == "not_judged", said.message
        assert "which XLA:CPU cannot run" in said.message and "not installed in this process" in said.message
    finally:
        rules[cpu_ragged_all_to_all._primitive()] = ours
        jax.clear_caches()
