"""The expert-parallel MoE example on CPU devices (not collected by the
suite itself: tests/test_multidevice.py runs this file in a process with 8
CPU devices): on 4 devices the sharded block (examples/moe_sharded.py) on the
Pallas path equals the block on one device, and the program runs with
--devices 8 (the XLA path)."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from examples import moe_block, moe_sharded

if len(jax.devices()) < 8:
  pytest.skip("needs 8 devices: run through tests/test_multidevice.py", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parent.parent
# Heads and experts divide by 8; head dim 16, the smallest a kernel dot takes.
SMALL = moe_block.BlockConfig(d_model=128, num_heads=8, num_experts=16, d_expert=64, top_k=3)


# The XLA path on 8 devices: test_module_runs_with_devices.
@pytest.mark.parametrize("devices, backend", [(4, "pallas")])
def test_expert_parallel_block_equals_one_device(devices, backend):
  params, x = moe_block.make_inputs(0, tokens=16, cfg=SMALL, batch=2)
  report = moe_sharded.compare_with_single_device(params, x, SMALL, moe_sharded.make_mesh(devices), backend)
  # No element outside the bf16 tolerance; not bit-equality, which depends on
  # the fp32 summation order XLA picks per host (the MoE part differed by
  # 6.1e-5 on a loaded 2-core host, 2026-12-06, at code that gave 0 before).
  assert {part: outside for part, (outside, _) in report.items()} == {"attention": 0, "moe": 0, "block": 0}, report


def test_expert_parallel_dispatch_moves_rows_to_their_experts_devices():
  """Experts split 4 ways: rows bound for device d get slots 0, 1, ... in order."""
  dest = jax.numpy.array([2, 0, 2, 3, 0, 2], jax.numpy.int32)
  assert moe_sharded._slots(dest, 4).tolist() == [0, 0, 1, 0, 1, 2]


def test_indivisible_sizes_are_a_clear_error():
  params, x = moe_block.make_inputs(0, tokens=12, cfg=SMALL, batch=1)
  with pytest.raises(ValueError, match="batch \\* tokens=12 must be a multiple of the 8 devices"):
    moe_sharded.compare_with_single_device(params, x, SMALL, moe_sharded.make_mesh(8), "xla")


@pytest.mark.slow  # a subprocess
def test_module_runs_with_devices():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # --devices creates them
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "examples.moe_block",
      "--devices",
      "8",
      "--tokens",
      "16",
      "--backend",
      "xla",
      "--iters",
      "1",
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=REPO,
    env=env,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  for part in ("attention", "moe", "block"):
    assert f"{part} (1, 16, 256) expert/tensor parallel on 8 cpu devices" in p.stdout, p.stdout
  assert p.stdout.count(" 0 of 4096 elements outside bf16 tolerance") == 3 and "sharded block" in p.stdout
