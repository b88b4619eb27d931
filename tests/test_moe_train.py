"""The MoE training example (examples/moe_train.py): from its fp32 master
weights the training block computes what the serving block
(examples/moe_block.py) computes on the quantized weights, bit for bit; a
few Adam steps through the straight-through FP8 x FP4 experts lower the loss
on the Pallas kernels (interpret mode here) and follow the XLA path's
steps; the module runs as a program. Needs optax (the `examples` extra,
installed by `make install`)."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")

from examples import moe_block, moe_train  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = moe_train.TRAIN_CONFIG


def test_the_training_block_is_the_serving_block_on_the_quantized_weights():
  master = moe_block.master_params(jax.random.key(3), CFG)
  x, _ = moe_train.make_batch(jax.random.key(4), CFG, tokens=16, batch=2)
  got = jax.jit(moe_train.block, static_argnums=(2, 3))(master, x, CFG, "xla")
  want = moe_block.block(moe_block.serving_params(master), x, CFG, "xla")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_training_lowers_the_loss_and_follows_the_xla_path():
  pallas = moe_train.train(3, tokens=16, backend="pallas")
  xla = moe_train.train(3, tokens=16, backend="xla")
  assert all(b < a for a, b in zip(pallas, pallas[1:])), pallas
  assert all(b < a for a, b in zip(xla, xla[1:])), xla
  np.testing.assert_allclose(pallas, xla, rtol=1e-2)


@pytest.mark.slow  # a subprocess
def test_module_runs_as_a_program():
  p = subprocess.run(
    [sys.executable, "-m", "examples.moe_train", "--backend", "xla", "--steps", "5", "--tokens", "16"],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout.count("step ") == 5 and "(decreasing)" in p.stdout
