"""TPU interpret mode's own callbacks take XLA's host arrays as they are
(:func:`conformance.interpreter_callbacks.on_host`): a kernel's run gives the same result bit
for bit, and every other callback (a kernel author's own ``io_callback``) still gets what JAX's path
gives it. Run on each env's JAX, so a JAX whose interpreter reads its operands another way fails here,
not in a kernel's verdict."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import callback as callback_module
from jax.experimental import io_callback

import conformance.kernels  # noqa: F401  (registers the built-ins)
from conformance import compat, interpreter_callbacks, runner
from conformance.fixtures.meshes import parse_mesh
from conformance.runner import Case

pytestmark = pytest.mark.selftest


def test_the_block_replaces_jaxs_callback_path_and_puts_it_back_once_every_block_has_left() -> None:
    original = callback_module.io_callback_impl
    with interpreter_callbacks.on_host():
        inside = callback_module.io_callback_impl
        assert inside is not original
        with interpreter_callbacks.on_host():
            assert callback_module.io_callback_impl is inside
        assert callback_module.io_callback_impl is inside  # the outer block is still inside
    assert callback_module.io_callback_impl is original


def test_an_authors_own_callback_still_gets_jax_arrays() -> None:
    seen: list[type] = []

    def note(x: np.ndarray) -> np.ndarray:
        seen.append(type(x))
        return np.asarray(x) + 1

    fn = jax.jit(lambda x: io_callback(note, jax.ShapeDtypeStruct((3,), jnp.float32), x))
    with interpreter_callbacks.on_host():
        out = fn(jnp.zeros(3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.ones(3))
    assert seen and all(issubclass(t, jax.Array) for t in seen), seen


def test_an_interpreted_ring_gives_the_same_result_bit_for_bit_and_its_races_flag() -> None:
    case = Case.make(
        "all_reduce",
        "pallas_ring_all_reduce_bidirectional",
        parse_mesh("5-x-explicit"),
        {"rows_per_shard": 3, "cols": 8},
        "float32",
        dma_mode="on_wait",
    )
    executable = runner.compiled(case, detect_races=True)
    placed = runner.place(case, runner.make_inputs(case))
    compat.reset_interpret_state()
    by_jax = np.asarray(jax.block_until_ready(executable(*placed)))
    raced_by_jax = compat.races_found()
    compat.reset_interpret_state()
    with interpreter_callbacks.on_host():
        on_host = np.asarray(jax.block_until_ready(executable(*placed)))
    assert on_host.tobytes() == by_jax.tobytes()
    assert not raced_by_jax
    assert not compat.races_found()


def test_a_wait_for_zero_returns_under_the_race_detector_and_the_next_call_still_runs() -> None:
    """JAX's interpreter asserts on a semaphore wait for 0 with ``detect_races=True`` (a kernel that
    waits for each peer's rows, where a peer sends none), and every later call fails: within the
    block the wait returns at once, as on a chip, and the class is JAX's own again after it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def kernel(x_ref, o_ref, sem):
        pl.semaphore_wait(sem, 0)
        o_ref[...] = x_ref[...] + 1

    def per_device(x):
        params = compat.interpret_params(dma_execution_mode="on_wait", detect_races=True)
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_shapes=[pltpu.SemaphoreType.REGULAR],
            interpret=params,
        )(x)

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    program = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    )
    x = jax.device_put(jnp.zeros((16, 128), jnp.float32), NamedSharding(mesh, P("x")))
    semaphore = interpreter_callbacks._semaphore_class()
    jaxs_own = semaphore.wait
    with interpreter_callbacks.on_host():
        for _ in range(2):
            assert np.array_equal(np.asarray(program(x)), np.ones((16, 128)))
        assert not compat.races_found()
    assert semaphore.wait is jaxs_own
