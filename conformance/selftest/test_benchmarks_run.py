"""The benchmarks keep working: a tiny ladder through the real command, its table and its JSON."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import conformance.kernels  # noqa: F401  (registers the built-ins counted below)
from conformance import registry, specs
from conformance.selftest import subprocess_env, suite_command

pytestmark = pytest.mark.selftest

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_ladder_prints_one_table_per_family_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = suite_command(
        "--bench-sizes=2K",
        "--bench-meshes=2-x-auto",
        "--bench-rounds=2",
        f"--benchmark-json={out}",
        marks="benchmark",
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for family in specs.FAMILIES:
        assert f"benchmark {family} on cpu" in proc.stdout, proc.stdout[-3000:]
    assert "CPU figures" in proc.stdout
    data = json.loads(out.read_text())
    rows = {b["name"]: b for b in data["benchmarks"]}
    transfers = {k: v for k, v in rows.items() if k.startswith("test_benchmark_send_recv[")}
    # every built-in implementation, baselines and the compiler's own included; send_recv: the two that
    # run on CPU x 2 routes x 2 dtypes (NCCL needs a GPU)
    # a baseline that claims only TPU and GPU (XLA's ragged-all-to-all) is not measured on CPU
    builtins = [
        i
        for f in specs.shard_map_families()
        for i in registry.registered(f)
        if i.is_builtin and (i.platforms is None or "cpu" in i.platforms)
    ]
    assert len(rows) - len(transfers) == len(builtins) and len(transfers) == 8, sorted(rows)
    for name, row in rows.items():
        info = row["extra_info"]
        ring = 1 if name in transfers else 2  # sendrecv: busbw = algbw; a ring of 2: half of it
        assert info["algbw_bytes_per_s"] > 0 and info["busbw_bytes_per_s"] == info["algbw_bytes_per_s"] / ring
        assert info["received_bytes_per_device"] > 0 and row["stats"]["median"] > 0
    assert re.search(r"jax_transfer_server +4-disjoint +bfloat16 +2048 .* +[0-9.]+ +2048 +2048 ", proc.stdout)


def test_the_default_cpu_run_times_nothing() -> None:
    cmd = suite_command("--collect-only", "-k", "benchmark")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert "test_benchmark[" not in proc.stdout, proc.stdout[-2000:]
