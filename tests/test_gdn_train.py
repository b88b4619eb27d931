"""The GDN training example (examples/gdn_train.py): a few Adam steps on the
Pallas kernels (interpret mode here) lower the loss and follow the XLA
path's steps; the parameter gradients of both paths agree (the initial
state and the gate parameters included) and the Pallas gradient runs GDN
prefill's backward kernels; the module runs as a program. Needs optax (the
`examples` extra, installed by `make install`)."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")

import gradients  # noqa: E402

from examples import gdn_train  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
# A sequence spanning a chunk boundary (70 tokens: chunks of 64 and 6), an empty one, a short one.
SMALL = gdn_train.GdnConfig(lengths=(70, 0, 9))


def test_training_lowers_the_loss_and_follows_the_xla_path():
  pallas = gdn_train.train(3, cfg=SMALL, backend="pallas")
  xla = gdn_train.train(3, cfg=SMALL, backend="xla")
  assert all(b < a for a, b in zip(pallas, pallas[1:])), pallas
  np.testing.assert_allclose(pallas, xla, rtol=1e-2)


def test_parameter_gradients_match_the_xla_path_and_run_the_backward_kernels():
  params = gdn_train.init_params(jax.random.key(2), SMALL)
  tokens, targets, _ = gdn_train.make_batch(jax.random.key(1), SMALL)
  grad = lambda backend: jax.jit(jax.grad(gdn_train.loss_fn), static_argnums=(3, 4))(  # noqa: E731
    params, tokens, targets, SMALL, backend
  )
  got, want = grad("pallas"), grad("xla")
  names = sorted(params)
  assert all(np.abs(np.asarray(want[n])).max() > 0 for n in names)
  gradients.assert_grads_close([got[n] for n in names], [want[n] for n in names], names)
  calls = gradients.pallas_calls(lambda p: jax.grad(gdn_train.loss_fn)(p, tokens, targets, SMALL, "pallas"), params)
  assert {
    "gdn_prefill_output",
    "gdn_prefill_bwd_dv",
    "gdn_prefill_bwd_state",
    "gdn_prefill_bwd_chunk",
    "gdn_prefill_bwd_dqk",
    "dense_gemm_nn",
    "dense_gemm_tn",
  } <= set(calls), calls


@pytest.mark.slow  # a subprocess
def test_module_runs_as_a_program():
  p = subprocess.run(
    [sys.executable, "-m", "examples.gdn_train", "--backend", "xla", "--steps", "5"],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout.count("step ") == 5 and "(decreasing)" in p.stdout
