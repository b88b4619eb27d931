"""Ops inside sharded programs, on one device (jaxkern.spmd, the split rules
of the families, pallas_kernels.shared.common.pallas_call): every op inside
`jax.shard_map` with its default `check_vma=True` on both paths and lowered
for an H100 there, Explicit-mesh sharding errors, and the rule machinery.
Splitting across several devices: tests/multidevice_ops.py (run by
tests/test_multidevice.py)."""

import functools

import jax
import jax.numpy as jnp
import kit
import numpy as np
import pytest
import sharding_cases
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkern import ops, registry, spmd
from pallas_kernels.shared import common, lowering

CASES = {c.label: c for c in sharding_cases.CASES}
GEMM_SPLIT = spmd.Split(
  inputs={"A": "m k", "B": "n k"}, outputs=("m n",), independent="m n", reasons={"k": "the contraction"}
)


def one_device_mesh(axis_type=jax.sharding.AxisType.Explicit):
  return jax.make_mesh((1,), ("x",), axis_types=(axis_type,))


def assert_same(out, expected):
  for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(e))


# ---------------------------------------------------------------------------
# The rules.


def test_every_op_declares_a_split_matching_its_definition():
  """Each implemented definition's split names every input and output
  dimension (ranks of the definition's tensors) and splits only names its
  inputs have."""
  for name in registry.names():
    op = registry.get(name)
    if not op.implemented:
      continue
    split = op.impl.split
    assert split is not None, name
    for tensor, spec in op.definition.inputs.items():
      assert len(split.dims(tensor)) == len(spec.shape or ()), (name, tensor)
    outputs = list(op.definition.outputs.values())
    assert len(split.outputs) == len(outputs), name
    for dims, spec in zip(split.output_dims(), outputs):
      assert len(dims) == len(spec.shape or ()), (name, dims)
    input_dims = {d for t in split.inputs for d in split.dims(t)}
    assert set(split.independent.split()) <= input_dims, name


def test_assign_reads_the_mesh_axes_of_each_split_dim():
  sizes = {"x": 2, "y": 2}
  shapes = {"A": (8, 4), "B": (6, 4)}
  factors = spmd.assign(GEMM_SPLIT, "gemm", {"A": P("x"), "B": P(("y",))}, shapes, sizes, strict=True)
  assert factors == {"m": ("x",), "n": ("y",)}
  assert spmd.spec_for(("m", "n"), factors) == P("x", "y")
  assert spmd.spec_for(("m", "k"), {"m": ("x", "y")}) == P(("x", "y"), None)


@pytest.mark.parametrize(
  "specs, message",
  [
    ({"A": P(None, "x")}, "dim 1 ('k'), which it cannot be split along: the contraction"),
    ({"A": P("x"), "B": P("x")}, "those axes already split another dim"),
    ({"A": P(("x", "y"))}, "4 shards do not divide input 'A' dim 0 (6)"),
  ],
)
def test_assign_rejects_what_the_op_cannot_follow(specs, message):
  shapes = {"A": (6, 4), "B": (8, 4)}
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    spmd.assign(GEMM_SPLIT, "gemm", specs, shapes, {"x": 2, "y": 2}, strict=True)
  # Not strict (the Auto-mesh partitioner): the dim is gathered instead.
  assert "k" not in spmd.assign(GEMM_SPLIT, "gemm", specs, shapes, {"x": 2, "y": 2}, strict=False)


def test_inputs_sharding_one_dim_alike():
  split = spmd.Split(inputs={"q": "b h", "k": "b h"}, outputs=("b h",), independent="b h")
  with pytest.raises(ValueError, match="another input shards 'h' over"):
    spmd.assign(
      split, "attn", {"q": P(None, "x"), "k": P(None, "y")}, {"q": (2, 4), "k": (2, 4)}, {"x": 2, "y": 2}, strict=True
    )


def test_sharding_rule_marks_what_must_stay_whole():
  """One Shardy factor per name and size (grouped heads of two sizes get two),
  the combined dims needing replication."""
  split = spmd.Split(inputs={"q": "b hq d", "v": "b h d"}, outputs=("b h d",), independent="b hq h")
  rule = spmd.sharding_rule(split, ["q", "v"], {"q": (2, 4, 8), "v": (2, 8, 8)}, [(2, 8, 8)])
  assert rule.operand_mappings == (("b_2", "hq_4", "d_8"), ("b_2", "h_8", "d_8"))
  assert rule.result_mappings == (("b_2", "h_8", "d_8"),)
  assert rule.need_replication_factors == ("d_8",)


@pytest.mark.device_stack
def test_varying_axes_outside_and_inside_shard_map():
  assert common.varying_axes(jnp.ones(3), 1.0) == frozenset()
  seen = []

  def body(x, w):
    seen.append((common.varying_axes(x), common.varying_axes(w), common.varying_axes(x, w)))
    return x

  jax.shard_map(body, mesh=one_device_mesh(jax.sharding.AxisType.Auto), in_specs=(P("x"), P()), out_specs=P("x"))(
    jnp.ones(2), jnp.ones(2)
  )
  assert seen == [(frozenset({"x"}), frozenset(), frozenset({"x"}))]


# ---------------------------------------------------------------------------
# Every op inside shard_map (check_vma=True), on one device.


@functools.cache
def case_inputs(label):
  return CASES[label].inputs()


def in_shard_map(case, backend, mesh, interpret=None):
  """The op inside `jax.shard_map` (default check_vma) splitting the case's
  first dim over "x" (a one-device mesh: the types are what matters)."""
  inputs = case_inputs(case.label)
  specs = case.in_specs(inputs, ("x",))
  return jax.shard_map(case.call(backend, interpret), mesh=mesh, in_specs=(specs,), out_specs=case.out_specs(("x",)))


# The device-stack lane's sharding smoke: a GEMM and an attention op.
LANE_SMOKE = ("dense_gemm_bf16_nt_n4096_k4096-m+n", "noncausal_dense_attention_h32_d64-b+h")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize(
  "label", [pytest.param(l, marks=pytest.mark.device_stack) if l in LANE_SMOKE else l for l in CASES]
)
def test_every_op_runs_inside_shard_map_with_vma_checks(label, backend):
  """Failed before for every Pallas kernel ("`manual_axis_type` on
  `jax.ShapeDtypeStruct` must not be `None`") and for the XLA path of the
  grouped GEMM, NATTEN and GDN prefill (loop carries of other types)."""
  case = CASES[label]
  inputs = case_inputs(label)
  mesh = one_device_mesh(jax.sharding.AxisType.Auto)
  out = jax.jit(in_shard_map(case, backend, mesh))(inputs)
  assert_same(out, jax.jit(case.call(backend))(inputs))


# H100 lowering on the GPU machine's jax (the lane); the main environment's jax
# lowers and compiles the heuristic configs in tests/test_aot.py.
@pytest.mark.lane_only
@pytest.mark.device_stack
@pytest.mark.parametrize("label", list(CASES))
def test_every_kernel_lowers_for_h100_when_sharded(label):
  """The Triton path declares how its outputs vary (no interpreter): inside a
  user's shard_map and in the dispatch's own (inputs sharded on an Explicit
  mesh under jit) the kernels lower to the same Triton calls as unsharded."""
  case = CASES[label]
  inputs = case_inputs(label)
  mesh = lowering.abstract_h100_mesh()
  specs = case.in_specs(inputs, ("x",))
  shapes = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in inputs.items()}
  sharded = {
    n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, specs[n])) for n, x in inputs.items()
  }
  plain = lowering.triton_calls(lowering.lower_for_h100(case.call("pallas", interpret=False), shapes))
  assert plain
  for fn in (in_shard_map(case, "pallas", mesh, interpret=False), case.call("pallas", interpret=False)):
    assert lowering.triton_calls(lowering.lower_for_h100(fn, sharded)) == plain


# ---------------------------------------------------------------------------
# jit over Explicit-mesh shardings: what cannot split is a clear error.


def test_contraction_dim_sharded_is_a_clear_error():
  mesh = one_device_mesh()
  a = jax.device_put(jnp.ones((8, 32), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
  b = jax.device_put(jnp.ones((16, 32), jnp.bfloat16), NamedSharding(mesh, P(None, "x")))
  for backend in ("xla", "pallas"):
    with pytest.raises(
      ValueError,
      match=r"dense_gemm_reference: input 'A' \(8, 32\) is sharded over mesh axes "
      r"\('x',\) along dim 1 \('k'\), which it cannot be split along: the "
      r"contraction",
    ):
      jax.jit(functools.partial(ops.dense_gemm, backend=backend))(a, b)


def test_experts_sharded_under_jit_point_to_shard_map():
  case = CASES["grouped_gemm_fp8_fp4_e384_n4608_k5120_g32-m+n"]
  mesh = one_device_mesh()
  inputs = dict(case_inputs(case.label))
  inputs["b"] = jax.device_put(inputs["b"], NamedSharding(mesh, P("x")))
  with pytest.raises(
    ValueError, match="rows carry global expert ids; for expert parallelism call the op inside jax.shard_map"
  ):
    jax.jit(lambda x: ops.grouped_gemm_fp8_fp4(**x, backend="xla"))(inputs)


def test_explicit_sharding_keeps_its_spec_through_the_op():
  """Heads sharded under jit on an Explicit mesh: the output keeps them (the
  XLA path failed: "0th dimension of all xs should be replicated")."""
  case = CASES["noncausal_dense_attention_h32_d64-b+h"]
  inputs = case_inputs(case.label)
  mesh = one_device_mesh()
  q, k, v = (jax.device_put(inputs[n], NamedSharding(mesh, P(None, None, "x"))) for n in "qkv")
  for backend in ("xla", "pallas"):
    out = jax.jit(functools.partial(ops.attention, backend=backend))(q, k, v)
    assert out.sharding.spec == P(None, None, "x", None)
    np.testing.assert_array_equal(
      np.asarray(out), np.asarray(ops.attention(*(inputs[n] for n in "qkv"), backend=backend))
    )


def test_kit_data_covers_every_family():
  families = {kit.family_of(n) for n in registry.names() if registry.get(n).implemented}
  assert families == {kit.family_of(c.definition) for c in sharding_cases.CASES}
