"""The training example (examples/video_train.py): a few Adam steps on the
Pallas kernels (interpret mode here) lower the loss and follow the XLA
path's steps; the parameter gradients of both paths agree and the Pallas
gradient runs the backward kernels of the three trainable families; the
module runs as a program. Needs optax (the `examples` extra, installed by
`make install`)."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")

import gradients  # noqa: E402

from examples import video_train  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
# Ragged extents (no tile divides them) and an uneven window.
SMALL = video_train.VideoConfig(frames=3, height=5, width=7, channels=3, window=(3, 3, 5))


def clips_and_params(cfg):
  noisy, clean = video_train.make_clips(jax.random.key(1), 2, cfg)
  return video_train.init_params(jax.random.key(2), cfg), noisy, clean


def test_training_lowers_the_loss_and_follows_the_xla_path():
  pallas = video_train.train(3, cfg=SMALL, backend="pallas")
  xla = video_train.train(3, cfg=SMALL, backend="xla")
  assert all(b < a for a, b in zip(pallas, pallas[1:])), pallas
  np.testing.assert_allclose(pallas, xla, rtol=1e-2)


def test_parameter_gradients_match_the_xla_path():
  params, noisy, clean = clips_and_params(SMALL)
  # A trained-like read-out, so gradients reach every weight.
  params["w_out"] = jax.random.normal(jax.random.key(3), params["w_out"].shape) * 0.2
  grad = lambda backend: jax.jit(jax.grad(video_train.loss_fn), static_argnums=(3, 4))(  # noqa: E731
    params, noisy, clean, SMALL, backend
  )
  got, want = grad("pallas"), grad("xla")
  names = sorted(params)
  assert all(np.abs(np.asarray(want[n])).max() > 0 for n in names)
  gradients.assert_grads_close([got[n] for n in names], [want[n] for n in names], names)


def test_gradient_runs_the_backward_kernels():
  params, noisy, clean = clips_and_params(SMALL)
  calls = gradients.pallas_calls(lambda p: jax.grad(video_train.loss_fn)(p, noisy, clean, SMALL, "pallas"), params)
  assert {
    "dense_gemm_nt",
    "dense_gemm_nn",
    "dense_gemm_tn",
    "neighborhood_attention_3d",
    "neighborhood_attention_3d_bwd_dq",
    "neighborhood_attention_3d_bwd_dkdv",
    "flash_attention",
    "flash_attention_bwd_dq",
    "flash_attention_bwd_dkdv",
  } <= set(calls), calls


@pytest.mark.slow  # a subprocess
def test_module_runs_as_a_program():
  p = subprocess.run(
    [sys.executable, "-m", "examples.video_train", "--backend", "xla", "--steps", "5"],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=REPO,
  )
  assert p.returncode == 0, p.stdout + p.stderr
  assert p.stdout.count("step ") == 5 and "(decreasing)" in p.stdout
