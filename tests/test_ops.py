"""`jaxkern.ops`: every function under `jax.jit` on both backends against the
definitions' references, with batch dimensions where the signature has them,
and the tuned-table seam."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sharding_cases
from numerics import assert_bf16_close

from jaxkern import backends, dataset, dispatch, ops, tuning
from jaxkern.families import dense_gemm as gemm_family
from jaxkern.families import flash_attention as attention_family
from jaxkern.families import moe_router as router_family
from pallas_kernels.dense_gemm import triton as dense_gemm
from pallas_kernels.moe_router.config import MoeRouterConfig
from pallas_kernels.shared.kernel import Unsupported

BACKENDS = ["pallas", "xla", None]  # None: XLA here (no GPU)


def normal(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * scale, jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_gemm_batched(backend):
  a, b = normal(0, (2, 3, 48)), normal(1, (40, 48), 48**-0.5)
  c = jax.jit(lambda a, b: ops.dense_gemm(a, b, backend=backend))(a, b)
  assert c.shape == (2, 3, 40) and c.dtype == jnp.bfloat16
  assert_bf16_close(c.reshape(6, 40), gemm_family.dense_gemm_reference(a.reshape(6, 48), b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_router_batched(backend):
  inputs = router_family.make_inputs({"M": 6, "D": 256, "E": 40, "TOPK": 6}, jax.random.key(3), None)
  hidden = inputs["hidden"].reshape(2, 3, 256)
  ids, weights = jax.jit(lambda h, w, b: ops.moe_router(h, w, b, backend=backend))(
    hidden, inputs["weight"], inputs["bias"]
  )
  assert ids.shape == weights.shape == (2, 3, 6) and ids.dtype == jnp.int32
  ref_ids, ref_w = router_family.moe_router_reference(**inputs)
  np.testing.assert_array_equal(np.asarray(ids).reshape(6, 6), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(weights).reshape(6, 6), np.asarray(ref_w), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_family(backend):
  q, k, v = normal(4, (2, 20, 2, 64)), normal(5, (2, 20, 2, 64)), normal(6, (2, 20, 2, 64))
  key_valid = jnp.arange(20)[None] < jnp.array([[20], [7]])
  kp, vp = normal(7, (2, 6, 2, 64)), normal(8, (2, 6, 2, 64))
  ids = jnp.broadcast_to(jnp.array([0] * 5 + [1] * 7 + [2] * 8, jnp.int32), (2, 20))
  f = jax.jit(lambda *a: ops.attention(*a[:3], key_valid=a[3], backend=backend))
  assert_bf16_close(f(q, k, v, key_valid), attention_family.noncausal_attention_reference(q, k, v, key_valid))
  f = jax.jit(lambda *a: ops.prefix_cached_attention(*a, backend=backend))
  assert_bf16_close(f(q, k, v, kp, vp), attention_family.prefix_cached_attention_reference(q, k, v, kp, vp))
  f = jax.jit(lambda *a: ops.block_causal_attention(*a, backend=backend))
  assert_bf16_close(f(q, k, v, ids), attention_family.block_causal_attention_reference(q, k, v, ids))


def test_attention_under_vmap_over_a_leading_axis():
  q = normal(9, (3, 1, 16, 2, 64))
  out = jax.vmap(lambda x: ops.attention(x, x, x, backend="pallas"))(q)
  ref = jax.vmap(lambda x: ops.attention(x, x, x, backend="xla"))(q)
  assert_bf16_close(out, ref)


def test_bad_backend_is_rejected():
  with pytest.raises(ValueError, match="backend"):
    ops.dense_gemm(normal(0, (2, 16)), normal(1, (16, 16)), backend="cuda")


def test_tuned_config_is_used_in_its_shape_bucket_and_the_heuristic_once_elsewhere(tmp_path, monkeypatch):
  """A call in a tuned shape bucket runs the tuned config; any other call
  gets the heuristic's config, computed once by the dispatch and passed to
  the kernel (which then computes none)."""
  monkeypatch.setenv("JAXKERN_TUNED_DIR", str(tmp_path))
  tuned = dense_gemm.DenseGemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=2)
  a, b = jax.ShapeDtypeStruct((3, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  bucket = backends.bucket_of(gemm_family.IMPL.kernels, {"A": a, "B": b}, {}, {})
  tuning.record("dense_gemm", "triton", bucket, tuned, latency_ms=1.0)
  seen, heuristics = [], []

  def spy(*args, config=None, **kw):
    seen.append(config)
    return dense_gemm.dense_gemm_nt(*args, config=config, **kw)

  def counted(shapes):
    heuristics.append(shapes)
    return dense_gemm.choose_config(shapes)

  kernel = dataclasses.replace(gemm_family.IMPL.default, launch=spy, choose_config=counted)
  monkeypatch.setattr(gemm_family, "IMPL", dataclasses.replace(gemm_family.IMPL, kernels={"triton": kernel}))
  jax.eval_shape(lambda a, b: ops.dense_gemm(a, b, backend="pallas"), a, b)
  assert seen == [tuned] and not heuristics
  jax.eval_shape(lambda a, b: ops.dense_gemm(a[:, :64], b[:, :64], backend="triton"), a, b)  # another bucket
  assert len(heuristics) == 1 and seen[1] == dense_gemm.choose_config(heuristics[0])


def test_one_dispatch_serves_every_op():
  """Every public op is its family's function and runs through
  `dispatch.run` once, whatever the backend."""
  for name in ops.__all__:
    if name not in ("Backend", "InputError", "checked"):
      assert getattr(ops, name).__module__.startswith("jaxkern.families."), name
  calls = []
  real = dispatch.run

  def counting(impl, inputs, **kw):
    calls.append((impl, kw["backend"]))
    return real(impl, inputs, **kw)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(dispatch, "run", counting)
    a, b = normal(0, (2, 16)), normal(1, (16, 16))
    for backend in ("xla", "pallas"):
      ops.dense_gemm(a, b, backend=backend)
  assert calls == [(gemm_family.IMPL, "xla"), (gemm_family.IMPL, "pallas")]


# --- vmap: a leading axis of independent problems --------------------------


def _vmapped_both_backends(fn, *args):
  """fn under jax.vmap on the Pallas and XLA paths."""
  return [
    jax.jit(jax.vmap(lambda *a, backend=backend: fn(*a, backend=backend)))(*args) for backend in ("pallas", "xla")
  ]


def test_dense_gemm_under_vmap_over_weights_and_activations():
  a = normal(10, (2, 5, 32))
  b = normal(11, (2, 24, 32), 32**-0.5)
  pallas, xla = _vmapped_both_backends(ops.dense_gemm, a, b)
  assert pallas.shape == (2, 5, 24)
  assert_bf16_close(pallas, xla)


def test_moe_router_under_vmap_over_layers():
  """Two layers' routers (weights and biases stacked) on their own tokens."""
  x = [router_family.make_inputs({"M": 3, "D": 128, "E": 24, "TOPK": 6}, jax.random.key(s), None) for s in (4, 5)]
  stack = lambda k: jnp.stack([i[k] for i in x])  # noqa: E731
  (ids_p, w_p), (ids_x, w_x) = _vmapped_both_backends(ops.moe_router, stack("hidden"), stack("weight"), stack("bias"))
  np.testing.assert_array_equal(np.asarray(ids_p), np.asarray(ids_x))
  np.testing.assert_allclose(np.asarray(w_p), np.asarray(w_x), rtol=1e-4, atol=2e-5)


def test_grouped_gemm_under_vmap_over_two_problems():
  from jaxkern import quant

  ka, kb = jax.random.split(jax.random.key(6))
  a, a_scale = quant.quantize_fp8_e4m3(jax.random.normal(ka, (2, 6, 64)), 32)
  b, b_scale = quant.quantize_e2m1(jax.random.normal(kb, (2, 4, 32, 64)) / 8, 32)
  ids = jnp.asarray([[0, 0, 1, 2, 3, -1], [1, 1, 1, 3, 3, 3]], jnp.int32)
  pallas, xla = _vmapped_both_backends(ops.grouped_gemm_fp8_fp4, a, a_scale, b, b_scale, ids)
  assert pallas.shape == (2, 6, 32)
  assert_bf16_close(pallas, xla)


def test_neighborhood_attention_under_vmap():
  q, k, v = (normal(s, (2, 1, 3, 5, 6, 1, 64), 0.5) for s in (12, 13, 14))
  f = lambda q, k, v, backend: ops.neighborhood_attention_3d(q, k, v, kernel_size=(3, 3, 3), backend=backend)  # noqa: E731
  pallas, xla = _vmapped_both_backends(f, q, k, v)
  assert_bf16_close(pallas, xla)


# --- backends -----------------------------------------------------------------


@pytest.mark.parametrize("case", sharding_cases.CASES, ids=lambda c: c.definition)
def test_triton_is_what_pallas_runs_for_every_op(case):
  """`backend="triton"` and `"pallas"` trace to the same program for every
  op (each family's default backend is Triton); so they compute the same."""
  inputs = case.inputs()
  pallas = jax.make_jaxpr(case.call("pallas", interpret=True))(inputs)
  triton = jax.make_jaxpr(case.call("triton", interpret=True))(inputs)
  assert str(triton) == str(pallas)
  assert "pallas_call" in str(triton)


def test_triton_equals_pallas_on_values():
  a, b = normal(0, (5, 48)), normal(1, (40, 48), 48**-0.5)
  np.testing.assert_array_equal(
    np.asarray(ops.dense_gemm(a, b, backend="triton")), np.asarray(ops.dense_gemm(a, b, backend="pallas"))
  )


def test_a_backend_the_op_lacks_names_the_ones_it_has():
  hidden, weight, bias = normal(0, (2, 16)), normal(1, (8, 16)), jnp.zeros((8,), jnp.float32)
  with pytest.raises(ValueError, match=r"moe_router has no 'mosaic_gpu' kernel; its backends: triton"):
    ops.moe_router(hidden, weight, bias, routed_scaling_factor=1.0, backend="mosaic_gpu")
  a, b = normal(0, (2, 16)), normal(1, (16, 16))
  with pytest.raises(
    TypeError,
    match=r"config MoeRouterConfig is no config of its kernels "
    r"\(triton: DenseGemmConfig, mosaic_gpu: MosaicGemmConfig\)",
  ):
    ops.dense_gemm(a, b, config=MoeRouterConfig(), backend="pallas")


def test_pallas_falls_back_to_triton_where_the_mosaic_gpu_gemm_refuses():
  """N = 40 is off the Mosaic GPU GEMM's 64-column store tiles: asked for
  by name it refuses with the reason; `pallas` (Triton first) runs."""
  a, b = normal(0, (2, 64)), normal(1, (40, 64), 64**-0.5)
  with pytest.raises(Unsupported, match=r"dense_gemm: no kernel takes these inputs .*mosaic_gpu: N=40 must be"):
    ops.dense_gemm(a, b, backend="mosaic_gpu")
  np.testing.assert_array_equal(
    np.asarray(ops.dense_gemm(a, b, backend="pallas")), np.asarray(ops.dense_gemm(a, b, backend="triton"))
  )


# Set while a test calls ops: the audit hook records what they open then.
_OPENED: list[str] | None = None


def _record_opens(event, args):
  if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
    _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


def test_ops_open_no_dataset_file(tmp_path, monkeypatch):
  """A model's call picks its config from the kernel's own shapes: no file
  under `datasets/` is opened (the tuned table, read once, is all)."""
  global _OPENED
  monkeypatch.setenv("JAXKERN_TUNED_DIR", str(tmp_path))
  calls = [(case.call("pallas", interpret=True), case.inputs()) for case in sharding_cases.CASES]
  a, b = normal(0, (5, 48)), normal(1, (40, 48), 48**-0.5)
  datasets = str(dataset.default_dataset_dir().resolve())
  _OPENED = []
  try:
    for call, inputs in calls:
      jax.eval_shape(call, inputs)
    ops.dense_gemm(a, b, backend="pallas")
    opened = list(_OPENED)
  finally:
    _OPENED = None
  assert not [p for p in opened if os.path.abspath(p).startswith(datasets)]
