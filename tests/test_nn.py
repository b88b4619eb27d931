"""The Flax NNX layers (`jaxkern.nn`): a two-layer model (causal
grouped-query attention + MoE) takes one optax step (`nnx.Optimizer`) on the
Pallas kernels (interpret mode here) as on the XLA path; attention and MoE
on the XLA path equal plain-jnp versions of themselves; every layer passes
`backend=` to its ops (the kernels in its gradient's jaxpr) and its
Pallas path matches its XLA path; sharding metadata; jaxkern imports no
flax, and jaxkern.nn without flax names the extra. Splitting the model
across devices: tests/multidevice_nn.py (run by tests/test_multidevice.py).
Needs flax and optax (the `nn` and `examples` extras)."""

import pathlib
import subprocess
import sys

import gradients
import jax
import jax.numpy as jnp
import numerics
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
pytest.importorskip("optax")

import optax  # noqa: E402
from flax import nnx  # noqa: E402

from examples import moe_block  # noqa: E402
from jaxkern import compare, nn, quant  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
D_IN, D_MODEL, D_OUT = 16, 64, 8


class TinyModel(nnx.Module):
  """Embedding, causal GQA attention, MoE (pre-norm residual blocks), read-out."""

  def __init__(self, backend, rngs, heads_axis=None):
    self.embed = nnx.Linear(D_IN, D_MODEL, rngs=rngs)
    self.norm1 = nnx.RMSNorm(D_MODEL, rngs=rngs)
    self.attention = nn.Attention(
      D_MODEL, 4, num_kv_heads=2, causal=True, backend=backend, heads_axis=heads_axis, rngs=rngs
    )
    self.norm2 = nnx.RMSNorm(D_MODEL, rngs=rngs)
    self.moe = nn.MoE(D_MODEL, 32, 8, 2, backend=backend, rngs=rngs)
    self.readout = nnx.Linear(D_MODEL, D_OUT, rngs=rngs)

  def __call__(self, x):
    h = self.embed(x)
    h = h + self.attention(self.norm1(h))
    h = h + self.moe(self.norm2(h))
    return self.readout(h)


def batch(seed=1, b=2, n=12):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (b, n, D_IN)), jax.random.normal(ky, (b, n, D_OUT))


def loss_fn(model, x, y):
  return jnp.mean(jnp.square(model(x) - y))


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss, grads


def one_step(backend):
  """(loss before, grads, loss after) of one Adam step from the seed-0 model."""
  model = TinyModel(backend, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, y = batch()
  loss, grads = train_step(model, optimizer, x, y)
  return float(loss), grads, float(nnx.jit(loss_fn)(model, x, y))


def test_two_layer_model_takes_the_xla_paths_step_on_the_kernels():
  loss, grads, after = one_step("pallas")
  want_loss, want_grads, want_after = one_step("xla")
  assert after < loss and want_after < want_loss
  np.testing.assert_allclose([loss, after], [want_loss, want_after], rtol=1e-2)
  got, want = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(want_grads)
  names = [jax.tree_util.keystr(path) for path, _ in want]
  assert [jax.tree_util.keystr(p) for p, _ in got] == names and len(names) == 13, names
  assert all(np.abs(np.asarray(g)).max() > 0 for _, g in want), names
  for name, (_, g), (_, w) in zip(names, got, want):
    assert_close_up_to_fp8_steps(name, g, w)


def assert_close_up_to_fp8_steps(name, got, want):
  """A gradient of the Pallas path against the XLA path's where an FP8
  quantization sits in between: the MoE rounds its rows to e4m3 (3 mantissa
  bits), so a one-ulp bf16 difference upstream (the kernels' fp32 summation
  order) can move a row by one FP8 step (up to 1/16 of it), or a near-tied
  token to another expert. At most 0.2% of the elements may miss
  `gradients.assert_grads_close`'s rule (bf16 rtol or 1% of the largest
  gradient), none by more than 5% of the largest; a gradient routed to a
  wrong element is off by O(the largest)."""
  x, y = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert x.shape == y.shape and np.all(np.isfinite(x)), name
  scale, err = np.abs(y).max(), np.abs(x - y)
  off = err > compare.DEFAULT_TOLERANCES["bfloat16"]["rtol"] * np.abs(y) + 0.01 * scale
  assert off.mean() <= 0.002 and err.max() <= 0.05 * scale, (name, int(off.sum()), off.size, err.max(), scale)


def attention_reference(layer, x, context=None, key_valid=None):
  """The layer in plain jnp: bf16 projections, fp32 softmax attention with
  k/v heads repeated (jnp.repeat), causal or key mask, rounded once to bf16."""

  def project(t, w):
    return jnp.einsum(
      "...k,nk->...n", t.astype(jnp.bfloat16), w[...].astype(jnp.bfloat16), preferred_element_type=jnp.float32
    ).astype(jnp.bfloat16)

  source = x if context is None else context
  h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
  q = project(x, layer.w_q).reshape(*x.shape[:2], h, d).astype(jnp.float32)
  k, v = (
    jnp.repeat(project(source, w).reshape(*source.shape[:2], hkv, d), h // hkv, axis=2) for w in (layer.w_k, layer.w_v)
  )
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * d**-0.5
  visible = jnp.ones(s.shape, bool)
  if layer.causal:
    visible = jnp.tril(visible)
  if key_valid is not None:
    visible = visible & key_valid[:, None, None, :]
  p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return project(o.astype(jnp.bfloat16).reshape(*x.shape[:2], h * d), layer.w_o).astype(x.dtype)


@pytest.mark.parametrize("kind", ["causal_gqa", "cross_masked"])
def test_attention_on_the_xla_path_is_plain_attention(kind):
  rngs = nnx.Rngs(3)
  x = jax.random.normal(jax.random.key(4), (2, 10, 64))
  if kind == "causal_gqa":
    layer = nn.Attention(64, 4, num_kv_heads=2, causal=True, backend="xla", rngs=rngs)
    args, kwargs = (x,), {}
  else:
    layer = nn.Attention(64, 2, head_dim=16, context_dim=32, backend="xla", rngs=rngs)
    context = jax.random.normal(jax.random.key(5), (2, 7, 32))
    key_valid = jnp.arange(7)[None, :] < jnp.array([[7], [4]])
    args, kwargs = (x, context), {"key_valid": key_valid}
  out = nnx.jit(lambda m, *a, **k: m(*a, **k))(layer, *args, **kwargs)
  assert out.shape == x.shape and out.dtype == x.dtype
  numerics.assert_bf16_close(out, attention_reference(layer, *args, **kwargs))


def test_moe_on_the_xla_path_is_the_plain_jnp_moe():
  """The layer against `examples/moe_block.py`'s jnp MoE (every expert on
  every token, dequantized MXFP4 weights, FP8 round trips) on its weights."""
  layer = nn.MoE(64, 32, 8, 3, backend="xla", rngs=nnx.Rngs(6))
  layer.router_bias[...] = 0.05 * jax.random.normal(jax.random.key(7), (8,))
  x = jax.random.normal(jax.random.key(8), (2, 12, 64)).astype(jnp.bfloat16)
  out = nnx.jit(lambda m, x: m(x))(layer, moe_block.rms_norm(x))

  def mxfp4(w):
    packed, scales = quant.quantize_e2m1(w[...], 32)
    return {"packed": packed, "scales": scales}

  serving = {
    "router": layer.router[...].astype(jnp.bfloat16),
    "router_bias": layer.router_bias[...],
    "w_gate_up": mxfp4(layer.w_gate_up),
    "w_down": mxfp4(layer.w_down),
  }
  cfg = moe_block.BlockConfig(d_model=64, num_experts=8, d_expert=32, top_k=3)
  bad, worst = moe_block.outside(out, moe_block.moe_reference(serving, x, cfg))
  assert bad == 0, worst
  assert float(jnp.abs(out.astype(jnp.float32)).mean()) > 0.05


def layer_cases():
  """name -> (layer on a backend, its inputs, the kernels its gradient runs)."""
  x_video = jax.random.normal(jax.random.key(1), (1, 3, 4, 5, 32))
  tokens = jax.random.normal(jax.random.key(2), (10, 32))
  return {
    "gdn": (
      lambda backend: nn.GatedDeltaNet(32, 1, 2, 16, backend=backend, rngs=nnx.Rngs(0)),
      (jax.random.normal(jax.random.key(3), (30, 32)), jnp.asarray([0, 10, 10, 30], jnp.int32)),
      {"gdn_prefill_serial", "gdn_prefill_bwd_chunk", "dense_gemm_nt", "dense_gemm_tn"},
    ),
    "neighborhood": (
      lambda backend: nn.NeighborhoodAttention3D(32, 2, (3, 3, 3), backend=backend, rngs=nnx.Rngs(0)),
      (x_video,),
      {"neighborhood_attention_3d", "neighborhood_attention_3d_bwd_dq", "dense_gemm_nn"},
    ),
    "sparse_mla": (
      lambda backend: nn.SparseMLA(32, 16, 32, backend=backend, rngs=nnx.Rngs(0)),
      (tokens, nn.causal_window_indices(10, 4)),
      {"sparse_mla_prefill", "dense_gemm_nt"},
    ),
    "cross_attention": (
      lambda backend: nn.Attention(32, 2, backend=backend, rngs=nnx.Rngs(0)),
      (jax.random.normal(jax.random.key(4), (2, 6, 32)), tokens.reshape(2, 5, 32)),
      {"flash_attention", "flash_attention_bwd_dkdv", "dense_gemm_nt"},
    ),
    "moe": (
      lambda backend: nn.MoE(32, 32, 4, 2, backend=backend, rngs=nnx.Rngs(0)),
      (tokens,),
      {"moe_router_one_launch", "grouped_gemm_fp8_fp4"},
    ),
  }


def weighted_sum(model, *args):
  y = model(*args)
  return jnp.sum(gradients.weights_like(y.shape) * y.astype(jnp.float32)), y


@pytest.mark.parametrize("name", ["gdn", "neighborhood", "sparse_mla", "cross_attention", "moe"])
def test_each_layer_passes_its_backend_to_its_ops(name):
  """Traced only: the Pallas path's gradient runs the layer's kernels
  (forward and backward), the XLA path's none."""
  make, args, kernels = layer_cases()[name]
  for backend, want in (("pallas", kernels), ("xla", set())):
    model = make(backend)
    calls = gradients.pallas_calls(lambda m: nnx.grad(weighted_sum, has_aux=True)(m, *args), model)
    assert want <= set(calls) and bool(calls) == bool(want), (backend, sorted(set(calls)))


@pytest.mark.parametrize("name", ["neighborhood", "sparse_mla"])
def test_layer_pallas_path_matches_the_xla_path(name):
  make, args, _ = layer_cases()[name]

  def run(backend):
    return nnx.jit(nnx.value_and_grad(weighted_sum, has_aux=True))(make(backend), *args)

  (_, out), grads = run("pallas")
  (_, want_out), want_grads = run("xla")
  numerics.assert_bf16_close(out, want_out)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(want_grads)]
  gradients.assert_grads_close(jax.tree.leaves(grads), jax.tree.leaves(want_grads), names)


def test_gdn_layer_returns_its_final_states_and_starts_from_given_ones():
  layer = nn.GatedDeltaNet(32, 1, 2, 16, backend="xla", rngs=nnx.Rngs(0))
  x, cu = jax.random.normal(jax.random.key(3), (30, 32)), jnp.asarray([0, 10, 10, 30], jnp.int32)
  y, state = layer(x, cu, return_state=True)
  assert y.shape == x.shape and state.shape == (3, 2, 16, 16) and not np.asarray(state[1]).any()
  # The second half of a sequence from the first half's state: the same outputs.
  first, mid = layer(x[:20], jnp.asarray([0, 10, 10, 20], jnp.int32), return_state=True)
  rest = layer(x[20:], jnp.asarray([0, 0, 0, 10], jnp.int32), initial_state=mid)
  assert isinstance(first, jax.Array) and isinstance(rest, jax.Array)
  numerics.assert_bf16_close(jnp.concatenate([first, rest]), y)


def test_sharding_metadata_names_the_heads_axis():
  mesh = jax.make_mesh((1,), ("model",))
  with jax.set_mesh(mesh):
    layer = nn.Attention(64, 4, num_kv_heads=2, heads_axis="model", rngs=nnx.Rngs(0))
    gdn = nn.GatedDeltaNet(32, 1, 2, 16, heads_axis="model", rngs=nnx.Rngs(0))
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer)))
  assert specs == {"w_q": P("model", None), "w_k": P("model", None), "w_v": P("model", None), "w_o": P(None, None)}
  assert layer.w_k[...].sharding.spec == P("model", None)  # placed when created
  gdn_specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(gdn)))
  assert gdn_specs["A_log"] == P("model") and gdn_specs["w_a"] == P("model", None)
  # Without heads_axis nothing is annotated (no mesh needed).
  plain = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(nn.Attention(64, 4, rngs=nnx.Rngs(0)))))
  assert plain["w_q"] == P()


def test_bad_configurations_are_clear_errors():
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    nn.Attention(64, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="d_expert=48 must be a multiple of 32"):
    nn.MoE(64, 48, 4, 2, rngs=nnx.Rngs(0))
  layer = nn.Attention(64, 4, causal=True, rngs=nnx.Rngs(0))
  x = jnp.zeros((1, 4, 64))
  with pytest.raises(ValueError, match="takes no key_valid"):
    layer(x, key_valid=jnp.ones((1, 4), bool))
  with pytest.raises(ValueError, match="pass no context"):
    layer(x, x)


@pytest.mark.slow  # a subprocess
def test_jaxkern_imports_no_flax_and_nn_without_flax_names_the_extra():
  script = """
import sys
import jaxkern, jaxkern.ops
assert "flax" not in sys.modules, "jaxkern.ops imported flax"
sys.modules["flax"] = None  # as if flax were not installed
try:
  import jaxkern.nn
except ImportError as e:
  print("ImportError:", e)
"""
  p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "ImportError: jaxkern.nn needs Flax" in p.stdout and "pip install 'jaxkern[nn]'" in p.stdout, p.stdout
