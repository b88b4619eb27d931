"""The example model block (examples/moe_block.py): the block on the Pallas
kernels (interpret mode here) and on the XLA path matches the same block
written in plain jnp within the bf16 tolerance, under jit; and the module runs
as a program."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from examples import moe_block

REPO = pathlib.Path(__file__).resolve().parent.parent
SMALL = moe_block.BlockConfig(d_model=128, num_heads=2, num_experts=8, d_expert=64, top_k=3)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_block_matches_the_plain_jnp_block(backend):
  params, x = moe_block.make_inputs(0, tokens=24, cfg=SMALL, batch=2)
  out = moe_block.block(params, x, SMALL, backend)
  assert out.shape == x.shape and out.dtype == x.dtype
  report = moe_block.compare_with_reference(params, x, SMALL, backend)
  assert all(bad == 0 for bad, _ in report.values()), report
  # Neither sublayer is a no-op: each changes the stream by O(0.1-1).
  attn = moe_block.attention_reference(params, x, SMALL)
  stream = moe_block.bf16_stream(x + attn)
  moe_out = np.asarray(moe_block.moe_reference(params, stream, SMALL), np.float32)
  assert float(np.abs(np.asarray(attn, np.float32)).mean()) > 0.05 and float(np.abs(moe_out).mean()) > 0.05


def test_dispatch_groups_rows_by_expert():
  ids = np.array([[3, 0, 5], [0, 2, 3]], np.int32)
  token, expert = moe_block.dispatch(ids)
  assert list(np.asarray(expert)) == [0, 0, 2, 3, 3, 5]
  assert list(np.asarray(token)) == [0, 1, 1, 0, 1, 0]


@pytest.mark.slow  # a subprocess
def test_module_runs_as_a_program():
  # The command line on the XLA path: the Pallas block is test_block_matches_the_plain_jnp_block's.
  p = subprocess.run(
    [sys.executable, "-m", "examples.moe_block", "--tokens", "16", "--backend", "xla", "--iters", "1"],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  for part in ("attention", "moe", "block"):
    assert f"{part} (1, 16, 256)" in p.stdout
  assert p.stdout.count(" 0 of 4096 elements outside bf16 tolerance") == 3 and "ms" in p.stdout
