"""Gated delta net decode step (SPEC 4.8): the kit's data (launches; decode
blockings for the kernel in interpret mode; lowering at every recorded
batch) and the family's own checks: the reference against an independent
float64 NumPy recurrence (shared with test_gdn_prefill.py), the scale, input
synthesis, CPU axes and the gradients of both paths. (The checks themselves: test_definitions.py and
kit.py.)"""

from __future__ import annotations

import json
import os

import gradients
import jax
import jax.numpy as jnp
import numpy as np
from kit import Case, TritonCall
from numerics import assert_bf16_close

from jaxkern import ops
from jaxkern.families import gdn_decode as fam_decode
from pallas_kernels.gdn_decode import triton as gk_decode

DECODE = "gdn_decode_qk4_v8_d128_k_last"
CONST = dict(num_q_heads=4, num_k_heads=4, num_v_heads=8, head_size=128)
_DATASET = os.path.join(os.path.dirname(__file__), os.pardir, "datasets")


def definition(name):
  with open(os.path.join(_DATASET, "definitions", f"{name}.json")) as f:
    return json.load(f)


def recorded_axes(name):
  with open(os.path.join(_DATASET, "workloads", f"{name}.jsonl")) as f:
    return [json.loads(line)["axes"] for line in f if line.strip()]


def decode_inputs(batch, seed=0):
  return fam_decode.make_decode_inputs(dict(batch_size=batch, seq_len=1, **CONST), jax.random.key(seed))


def launches(config, axes):
  """Grid (B, HV, V blocks)."""
  d = axes["head_size"]
  return [
    TritonCall(
      "gdn_decode",
      (axes["batch_size"], axes["num_v_heads"], d // min(config.block_v, d)),
      config.num_warps,
      config.num_stages,
    )
  ]


KERNEL_CASES = [
  Case(
    DECODE, {"batch_size": batch}, config=gk_decode.GdnDecodeConfig(block_v=block_v), id=f"b{batch}_block_v{block_v}"
  )
  for batch, block_v in [(1, 16), (3, 32), (64, 128)]
]
LOWERING_CASES = [
  Case(DECODE, {"batch_size": b}, id=f"b{b}") for b in sorted({a["batch_size"] for a in recorded_axes(DECODE)})
]


# ------------------------------------------------------- float64 NumPy model


def numpy_gdn(x, lengths):
  """Independent float64 recurrence, token by token (prefill layout; decode
  is the one-token case). Returns (output [T, HV, D], new_state [N, HV, V, K])."""
  f64 = lambda name: np.asarray(x[name], np.float64)
  q, k, v, a, b = f64("q"), f64("k"), f64("v"), f64("a"), f64("b")
  a_log, dt_bias, state = f64("A_log"), f64("dt_bias"), f64("state")
  hq, hv, d = q.shape[1], v.shape[1], q.shape[2]
  scale = float(x["scale"]) or 1.0 / np.sqrt(d)
  out = np.zeros(v.shape)
  new_state = np.zeros(state.shape)
  t = 0
  for n, length in enumerate(lengths):
    s = state[n].transpose(0, 2, 1).copy()  # [HV, K, V]
    for _ in range(length):
      for h in range(hv):
        x_ = a[t, h] + dt_bias[h]
        softplus = x_ if x_ > 20 else np.log1p(np.exp(x_))
        g = np.exp(-np.exp(a_log[h]) * softplus)
        beta = 1.0 / (1.0 + np.exp(-b[t, h]))
        kk, qq = k[t, h // (hv // hq)], q[t, h // (hv // hq)]
        s[h] *= g
        s[h] += np.outer(kk, beta * (v[t, h] - kk @ s[h]))
        out[t, h] = scale * (qq @ s[h])
      t += 1
    if length:
      new_state[n] = s.transpose(0, 2, 1)
  return out, new_state


def test_decode_reference_matches_float64():
  x = decode_inputs(3, seed=4)
  out, new_state = fam_decode.gdn_decode_reference(**x)
  flat = {n: (v[:, 0] if n in ("q", "k", "v", "a", "b") else v) for n, v in x.items()}
  want_out, want_state = numpy_gdn(flat, [1, 1, 1])
  assert_bf16_close(out[:, 0], want_out)
  np.testing.assert_allclose(np.asarray(new_state), want_state, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- decode


WHOLE_HEAD = gk_decode.GdnDecodeConfig(block_v=128)


def test_decode_scale():
  x = decode_inputs(2, seed=9)
  default = gk_decode.gdn_decode(**x, config=WHOLE_HEAD, interpret=True)[0]
  explicit = gk_decode.gdn_decode(**{**x, "scale": jnp.float32(128**-0.5)}, config=WHOLE_HEAD, interpret=True)[0]
  np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(explicit, np.float32))
  x["scale"] = jnp.float32(1.0)
  out = gk_decode.gdn_decode(**x, config=WHOLE_HEAD, interpret=True)[0]
  assert_bf16_close(out, fam_decode.gdn_decode_reference(**x)[0])
  assert np.abs(np.asarray(out, np.float32)).max() > 4 * np.abs(np.asarray(default, np.float32)).max()


def test_decode_scale_traced_under_jit():
  x = decode_inputs(2, seed=10)
  f = jax.jit(lambda s: gk_decode.gdn_decode(**{**x, "scale": s}, config=WHOLE_HEAD, interpret=True)[0])
  assert_bf16_close(f(jnp.float32(0.5)), fam_decode.gdn_decode_reference(**{**x, "scale": 0.5})[0])


# ---------------------------------------------------------------- synthesis


# ---------------------------------------------------------------- gradients

DIFFERENTIABLE = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b")


def decode_loss(backend, weights):
  def f(*args):
    out, new_state = ops.gdn_decode(*args, sm_scale=1.0, backend=backend)
    return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(new_state * weights[1])

  return f


def test_decode_gradients_of_both_paths_agree_under_jit():
  """The Pallas path (interpret mode; backward through the reference's VJP,
  `jaxkern.autodiff`) against the XLA path for every floating input."""
  x = decode_inputs(3, seed=6)
  args = tuple(x[n] for n in DIFFERENTIABLE)
  weights = (gradients.weights_like(x["v"].shape, 1), gradients.weights_like(x["state"].shape, 2))
  argnums = tuple(range(len(args)))
  pallas = jax.jit(jax.grad(decode_loss("pallas", weights), argnums))(*args)
  xla = jax.jit(jax.grad(decode_loss("xla", weights), argnums))(*args)
  gradients.assert_grads_close(pallas, xla, DIFFERENTIABLE)
  assert all(np.abs(np.asarray(g, np.float32)).max() > 0 for g in pallas)


def test_decode_gradients_match_float64_finite_differences():
  """float32 inputs (B=2, HQ=1, HV=2, D=4) on the XLA path against central
  differences of the float64 recurrence."""
  rng = np.random.default_rng(8)
  b, hq, hv, d = 2, 1, 2, 4
  x64 = {
    "q": rng.standard_normal((b, 1, hq, d)) * 0.5,
    "k": rng.standard_normal((b, 1, hq, d)) * 0.5,
    "v": rng.standard_normal((b, 1, hv, d)),
    "state": rng.standard_normal((b, hv, d, d)) * 0.5,
    "A_log": rng.uniform(-1.0, 0.5, hv),
    "a": rng.standard_normal((b, 1, hv)),
    "dt_bias": rng.uniform(-1.0, 0.5, hv),
    "b": rng.standard_normal((b, 1, hv)),
  }
  weights = (gradients.weights_like((b, 1, hv, d), 3), gradients.weights_like((b, hv, d, d), 4))
  got = jax.grad(decode_loss("xla", weights), tuple(range(8)))(
    *(jnp.asarray(x64[n], jnp.float32) for n in DIFFERENTIABLE)
  )

  def fn64(*values):
    x = {n: v[:, 0] if n in ("q", "k", "v", "a", "b") else v for n, v in zip(DIFFERENTIABLE, values)}
    out, new_state = numpy_gdn({**x, "scale": 1.0}, (1,) * b)
    return np.concatenate([out.ravel(), new_state.ravel()])

  w64 = np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])
  want = gradients.finite_difference_grads(fn64, [x64[n] for n in DIFFERENTIABLE], w64)
  for name, g, w in zip(DIFFERENTIABLE, got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-3, atol=2e-3 * np.abs(w).max(), err_msg=name)


def check_against_definition(name, inputs, axes):
  d = definition(name)
  full = {**{n: a.get("value") for n, a in d["axes"].items()}, **axes}
  assert list(inputs) == list(d["inputs"])
  for n, spec in d["inputs"].items():
    shape = () if spec["shape"] is None else tuple(full[a] for a in spec["shape"])
    assert inputs[n].shape == shape, n
    assert inputs[n].dtype == jnp.dtype(spec["dtype"]), n


def test_decode_synthesis():
  axes = dict(batch_size=64, seq_len=1, **CONST)
  x = fam_decode.make_decode_inputs(axes, jax.random.key(1))
  check_against_definition(DECODE, x, axes)
  y = fam_decode.make_decode_inputs(axes, jax.random.key(1))
  for n in x:
    np.testing.assert_array_equal(np.asarray(x[n], np.float32), np.asarray(y[n], np.float32))
  z = fam_decode.make_decode_inputs(axes, jax.random.key(2))
  assert not np.array_equal(np.asarray(x["v"], np.float32), np.asarray(z["v"], np.float32))
  for n in ("q", "k"):
    norms = np.linalg.norm(np.asarray(x[n], np.float32), axis=-1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-2)
  g, beta = fam_decode.gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
  g, beta = np.asarray(g), np.asarray(beta)
  assert g.min() < 0.1 and g.max() > 0.95 and np.all((g > 0) & (g <= 1))
  assert beta.min() < 0.1 and beta.max() > 0.9
  assert float(x["scale"]) == 0.0


def test_cpu_axes_keep_structure():
  for axes in recorded_axes(DECODE):
    small = fam_decode.decode_cpu_axes({**axes, "seq_len": 1, **CONST})
    assert 1 <= small["batch_size"] <= 8 and small["seq_len"] == 1
