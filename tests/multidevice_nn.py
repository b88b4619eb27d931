"""The `jaxkern.nn` model of tests/test_nn.py split across CPU devices (not
collected by the suite itself: tests/test_multidevice.py runs this file in
a process with 8 CPU devices): on an Explicit 4 x 2 mesh, the batch split 4
ways over "data" and the attention heads 2 ways over "model" (the layer's
`heads_axis`, its parameters placed by their sharding metadata), one jitted
optax step gives the single-device step's loss and gradients. The XLA
path: the layers' sharding is the same on both paths, and the kernels per
shard are tests/multidevice_ops.py's (the Pallas path of this test passes
too, at several times the cost)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_nn import TinyModel, assert_close_up_to_fp8_steps, batch, loss_fn, train_step

if len(jax.devices()) < 8:
  pytest.skip("needs 8 devices: run through tests/test_multidevice.py", allow_module_level=True)


def test_data_and_head_parallel_train_step_equals_one_device():
  backend = "xla"
  x, y = batch(b=4, n=8)
  model = TinyModel(backend, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  want_loss, want_grads = train_step(model, optimizer, x, y)
  want_after = float(nnx.jit(loss_fn)(model, x, y))

  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  with jax.set_mesh(mesh):
    model = TinyModel(backend, nnx.Rngs(0), heads_axis="model")
    assert model.attention.w_q[...].sharding.spec == P("model", None)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    rows = NamedSharding(mesh, P("data"))
    x, y = jax.device_put(x, rows), jax.device_put(y, rows)
    loss, grads = train_step(model, optimizer, x, y)
    after = float(nnx.jit(loss_fn)(model, x, y))
  assert grads["attention"]["w_q"][...].sharding.spec == P("model", None)
  np.testing.assert_allclose([float(loss), after], [float(want_loss), want_after], rtol=1e-2)
  got, want = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(want_grads)
  assert len(got) == len(want) == 13
  for (path, g), (_, w) in zip(got, want):
    assert_close_up_to_fp8_steps(jax.tree_util.keystr(path), np.asarray(g), w)
