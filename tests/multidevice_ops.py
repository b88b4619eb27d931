"""Ops split across CPU devices (not collected by the suite itself:
tests/test_multidevice.py runs this file in a process with 8 CPU devices).

Issue 25's failures, each as a user met them, then every op split over a
2 x 2 mesh under `jit`, with inputs sharded on an Explicit mesh
(`jax.make_mesh`'s default; the dispatch runs the op per shard in a
`jax.shard_map`) and on a classic Auto mesh (`jax.sharding.Mesh`), against
the reference on one device."""

import functools

import gradients
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
import sharding_cases
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkern import ops, quant, registry

if len(jax.devices()) < 4:
  pytest.skip("needs 4 devices: run through tests/test_multidevice.py", allow_module_level=True)

CASES = {c.label: c for c in sharding_cases.CASES}
BACKENDS = ["xla", "pallas"]


def mesh_1d(axis_type=AxisType.Explicit, devices=4):
  return jax.make_mesh((devices,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:devices])


def mesh_2d(axis_type=AxisType.Explicit):
  return jax.make_mesh((2, 2), sharding_cases.MESH_AXES, axis_types=(axis_type,) * 2, devices=jax.devices()[:4])


def place(x, mesh, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def normal(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def synthesized(name, axes):
  op = registry.get(name)
  return op.make_inputs(op.definition.full_axes(axes), seed=1, allow_shrunk_constants=True)


def assert_close_tree(out, expected):
  for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
    numerics.assert_close(o, e, "float32" if e.dtype == jnp.float32 else "bfloat16")


# ---------------------------------------------------------------------------
# Issue 25, first item: the Pallas path inside shard_map (check_vma=True)
# raised "`manual_axis_type` on `jax.ShapeDtypeStruct` must not be `None`";
# the XLA path of the grouped GEMM and NATTEN "carry input and carry output
# must have equal types".


def attention_over_heads():
  q, k, v = (normal(i, (2, 16, 4, 64)) for i in range(3))
  return ops.attention, (q, k, v), {}, (P(None, None, "x"),) * 3, P(None, None, "x")


def dense_gemm_over_rows():
  return ops.dense_gemm, (normal(0, (32, 64)), normal(1, (48, 64))), {}, (P("x"), P()), P("x")


def grouped_gemm_over_experts():
  """Experts split across the devices; each device's rows are its own
  experts' with local ids (what expert-parallel dispatch delivers)."""
  devices, local_experts, rows, n, k = 4, 2, 6, 64, 128
  a, a_scale = quant.quantize_fp8_e4m3(normal(0, (devices * rows, k), jnp.float32), 32)
  b, b_scale = quant.quantize_e2m1(normal(1, (devices * local_experts, n, k), jnp.float32) * k**-0.5, 32)
  local_ids = jnp.tile(jnp.array([0, 0, 0, 1, 1, -1], jnp.int32), devices)
  args = (a, a_scale, b, b_scale, local_ids)
  return ops.grouped_gemm_fp8_fp4, args, {}, (P("x"),) * 5, P("x")


def gdn_decode_over_batch():
  x = synthesized("gdn_decode_qk4_v8_d128_k_last", {"batch_size": 4})
  args = tuple(x[n] for n in ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "scale"))
  specs = (P("x"), P("x"), P("x"), P("x"), P(), P("x"), P(), P("x"), P())
  return gdn_decode_scaled, args, {}, specs, (P("x"), P("x"))


def gdn_decode_scaled(*args, **kwargs):
  """`ops.gdn_decode` with its scale as a ninth (shardable) argument."""
  return ops.gdn_decode(*args[:8], sm_scale=args[8], **kwargs)


def natten_over_batch():
  x = synthesized("neighborhood_attention_3d_h8_d64_kt3_ky5_kx5", {"B": 4, "T": 3, "Y": 5, "X": 5, "H": 1})
  return (ops.neighborhood_attention_3d, (x["q"], x["k"], x["v"]), {"kernel_size": (3, 5, 5)}, (P("x"),) * 3, P("x"))


def sparse_mla_over_heads():
  x = synthesized("sparse_mla_prefill_h64_d512_k128", {"M": 4, "Nkv": 64, "H": 64, "D": 128})
  args = (x["q"], x["kv"], x["indices"], x["attn_sink"])
  return (
    ops.sparse_mla_prefill,
    args,
    {"sm_scale": x["sm_scale"]},
    (P(None, "x"), P(), P(), P("x")),
    (P(None, "x"), P(None, "x")),
  )


def expected_grouped(args):
  """The expert-parallel grouped GEMM on one device: global expert ids."""
  a, a_scale, b, b_scale, local_ids = args
  offsets = jnp.repeat(jnp.arange(4, dtype=jnp.int32) * 2, local_ids.shape[0] // 4)
  return a, a_scale, b, b_scale, jnp.where(local_ids < 0, -1, local_ids + offsets)


ISSUE_OPS = {
  f.__name__: f
  for f in (
    attention_over_heads,
    dense_gemm_over_rows,
    grouped_gemm_over_experts,
    gdn_decode_over_batch,
    natten_over_batch,
    sparse_mla_over_heads,
  )
}


@pytest.mark.parametrize("name", list(ISSUE_OPS))
def test_issue_ops_inside_shard_map(name):
  """The Pallas path; the XLA path inside a shard_map is the "explicit-xla"
  setting below (the dispatch's own shard_map) and, with its loop carries,
  tests/test_spmd.py."""
  backend = "pallas"
  op, args, kwargs, in_specs, out_specs = ISSUE_OPS[name]()
  mesh = mesh_1d()
  placed = [place(a, mesh, s) for a, s in zip(args, in_specs)]
  fn = functools.partial(op, **kwargs, backend=backend)
  out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*placed)
  single = expected_grouped(args) if name == "grouped_gemm_over_experts" else args
  assert_close_tree(out, jax.jit(fn)(*single))


# ---------------------------------------------------------------------------
# Issue 25, second and third items: jit over inputs sharded on an Explicit
# mesh ("0th dimension of all xs should be replicated", "pallas_call requires
# all mesh axes to be Manual", the grouped GEMM's ShardingTypeError), and on
# a classic mesh, where Pallas outputs came back replicated.


@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_sharded_attention_under_jit_on_an_explicit_mesh(backend):
  _, (q, k, v), _, specs, out_spec = attention_over_heads()
  mesh = mesh_1d()
  out = jax.jit(functools.partial(ops.attention, backend=backend))(
    *(place(x, mesh, s) for x, s in zip((q, k, v), specs))
  )
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), out.ndim)
  numerics.assert_bf16_close(out, ops.attention(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_sharded_grouped_gemm_under_jit_on_an_explicit_mesh(backend):
  case = CASES["grouped_gemm_fp8_fp4_e384_n4608_k5120_g32-m+n"]
  inputs = case.inputs()
  mesh = mesh_1d()
  placed = {n: place(x, mesh, P("x") if n in ("a", "a_scale", "expert_ids") else P()) for n, x in inputs.items()}
  out = jax.jit(lambda x: ops.grouped_gemm_fp8_fp4(**x, backend=backend))(placed)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), out.ndim)
  numerics.assert_bf16_close(out, ops.grouped_gemm_fp8_fp4(**inputs, backend=backend))


@pytest.mark.parametrize("name", ["attention_over_heads", "dense_gemm_over_rows"])
def test_classic_mesh_pallas_outputs_keep_the_sharding(name):
  op, args, kwargs, in_specs, out_spec = ISSUE_OPS[name]()
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  fn = jax.jit(
    functools.partial(op, **kwargs, backend="pallas"), in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs)
  )
  out = fn(*args)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), out.ndim), out.sharding
  numerics.assert_bf16_close(out, op(*args, **kwargs, backend="pallas"))


def test_only_some_inputs_sharded_get_resharded_to_match():
  """q split by heads, k and v whole: k and v get their heads' slices."""
  _, (q, k, v), _, _, out_spec = attention_over_heads()
  mesh = mesh_1d()
  out = jax.jit(functools.partial(ops.attention, backend="pallas"))(place(q, mesh, P(None, None, "x")), k, v)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), out.ndim)
  numerics.assert_bf16_close(out, ops.attention(q, k, v, backend="pallas"))


def test_vmap_and_grad_on_sharded_inputs():
  """Auto mesh, Pallas path: vmap falls back to one call; Explicit mesh, XLA
  path: the per-shard shard_map differentiates."""
  a, b = normal(0, (3, 32, 64)), normal(1, (48, 64))
  auto = mesh_1d(AxisType.Auto)
  out = jax.jit(jax.vmap(functools.partial(ops.dense_gemm, backend="pallas"), in_axes=(0, None)))(
    place(a, auto, P(None, "x")), b
  )
  numerics.assert_bf16_close(out, jax.vmap(functools.partial(ops.dense_gemm, backend="xla"), in_axes=(0, None))(a, b))
  explicit = mesh_1d()

  def loss(a, b):
    return jnp.sum(ops.dense_gemm(a, b, backend="xla").astype(jnp.float32))

  with jax.set_mesh(explicit):  # JAX's rule for gradients of Explicit-sharded programs
    grad = jax.jit(jax.grad(loss))(place(a[0], explicit, P("x")), b)
  assert grad.sharding.is_equivalent_to(NamedSharding(explicit, P("x")), grad.ndim)
  numerics.assert_bf16_close(grad, jax.grad(loss)(a[0], b))


def test_gdn_prefill_gradients_with_heads_split():
  """The GDN prefill's own backward kernels per shard: every floating input
  split by heads (scale replicated) on an Explicit and an Auto mesh; the
  gradients equal the unsplit XLA path's."""
  x = synthesized("gdn_prefill_qk4_v8_d128_k_last", {"total_seq_len": 40, "num_seqs": 2, "len_cu_seqlens": 3})
  x["scale"] = jnp.float32(0.8)
  names = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "scale")
  heads = {
    "q": P(None, "x"),
    "k": P(None, "x"),
    "v": P(None, "x"),
    "state": P(None, "x"),
    "A_log": P("x"),
    "a": P(None, "x"),
    "dt_bias": P("x"),
    "b": P(None, "x"),
    "scale": P(),
  }
  weights = [normal(2, x["v"].shape, jnp.float32), normal(3, x["state"].shape, jnp.float32)]

  def loss(backend):
    def f(*args):
      out, new_state = ops.gdn_prefill(*args[:8], x["cu_seqlens"], sm_scale=args[8], backend=backend)
      return jnp.sum(out.astype(jnp.float32) * weights[0]) + jnp.sum(new_state * weights[1])

    return jax.jit(jax.grad(f, tuple(range(len(names)))))

  want = loss("xla")(*(x[n] for n in names))
  for mesh in (mesh_1d(devices=4), mesh_1d(AxisType.Auto, devices=4)):
    with jax.set_mesh(mesh):
      got = loss("pallas")(*(place(x[n], mesh, heads[n]) for n in names))
    gradients.assert_grads_close(got, want, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_straight_through_gemm_gradients_with_rows_and_columns_split(backend):
  """`ops.grouped_gemm_mxfp4_ste` with rows split over "x" and the weights'
  columns N over "y" (Explicit 2 x 2 mesh, under jit): its shard_map sums
  the weights' gradient over the row shards and the rows' over the column
  shards; both equal one device's."""
  m, e, n, k = 24, 4, 64, 64
  x, w = normal(0, (m, k)), normal(1, (e, n, k), jnp.float32) * k**-0.5
  ids = jnp.asarray(np.random.default_rng(0).integers(-1, e + 1, m), jnp.int32)
  weights = normal(2, (m, n), jnp.float32)

  def grads(x, w, ids, weights):
    def loss(x, w):
      return jnp.sum(ops.grouped_gemm_mxfp4_ste(x, w, ids, backend=backend).astype(jnp.float32) * weights)

    return jax.grad(loss, (0, 1))(x, w)

  want = jax.jit(grads)(x, w, ids, weights)
  mesh = mesh_2d()
  with jax.set_mesh(mesh):
    got = jax.jit(grads)(
      place(x, mesh, P("x")), place(w, mesh, P(None, "y")), place(ids, mesh, P("x")), place(weights, mesh, P("x", "y"))
    )
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2), got[0].sharding
  assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "y")), 3), got[1].sharding
  gradients.assert_grads_close(got, want, ("x", "w"))


# ---------------------------------------------------------------------------
# Every op, every setting.


# A user's shard_map runs the op as the dispatch's own does under
# "explicit" (per shard, over both mesh axes), so it is not a setting of its
# own here; tests/test_spmd.py runs every op inside one on both paths.
SETTINGS = ["explicit-xla", "explicit-pallas", "auto-pallas"]


@functools.cache
def inputs_of(label):
  return CASES[label].inputs()


@functools.cache
def single_device(label):
  """The reference on one device: what the kit compares every kernel with."""
  return jax.jit(CASES[label].call("xla"))(inputs_of(label))


# Every op's kernel path splits on an explicit mesh. Auto-mode meshes reach
# the same per-shard calls once the dispatch has resharded, and the XLA path
# runs the references under the same split rules (tests/test_spmd.py checks
# those rules on one device): a few families stand for all there.
FEW_LABELS = {label for label in CASES if label.startswith(("dense_gemm", "grouped_gemm", "noncausal", "qsa_sparse"))}
SPLITS = [
  (label, setting) for label in CASES for setting in SETTINGS if setting == "explicit-pallas" or label in FEW_LABELS
]


@pytest.mark.parametrize("label,setting", SPLITS)
def test_every_op_split_across_devices(label, setting):
  """The case's dims split over a 2 x 2 mesh match the reference on one
  device (the kit's comparison); the outputs keep that sharding."""
  mode, backend = setting.split("-")
  case = CASES[label]
  inputs = inputs_of(label)
  specs = case.in_specs(inputs)
  mesh = mesh_2d(AxisType.Auto if mode == "auto" else AxisType.Explicit)
  placed = {n: place(x, mesh, specs[n]) for n, x in inputs.items()}
  out = jax.jit(case.call(backend))(placed)
  op = case.op
  result = op.compare(op.name_outputs(out), op.name_outputs(single_device(label)), inputs=inputs)
  assert result.passed, {k: o.message for k, o in result.outputs.items() if o.message}
  out_specs = case.out_specs()
  for o, spec in zip(jax.tree.leaves(out), out_specs if isinstance(out_specs, tuple) else (out_specs,)):
    assert o.sharding.is_equivalent_to(NamedSharding(mesh, spec), o.ndim), (o.sharding, spec)
