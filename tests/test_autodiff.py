"""Gradients of the ops without Pallas backward kernels (`jaxkern.autodiff`,
applied by `jaxkern.dispatch.run`): for one definition of every such family
at CPU size, `jax.grad` on the Pallas path (the kernel forward, the
reference's VJP backward) equals the XLA path's under jit, with respect to
every floating input of 16 bits or more, or - where the reference cannot be
differentiated - raises `NotDifferentiableError` naming the op; asking for
the gradient of a quantized input raises it on both paths, naming the op
and the input. (The families with their own backward kernels: their test
files.)"""

import gradients
import jax
import jax.numpy as jnp
import kit
import pytest

from jaxkern import dataset, dispatch, registry
from jaxkern import plan as plan_lib
from jaxkern.autodiff import NotDifferentiableError

# Autodiff smoke of every family: also in the device-stack lane.
pytestmark = pytest.mark.device_stack

IMPLEMENTED = [n for n in registry.names() if registry.get(n).implemented]


def first_of_each_family(names):
  out = {}
  for n in names:
    out.setdefault(kit.family_of(n), n)
  return sorted(out.values())


THROUGH_REFERENCE = first_of_each_family(n for n in IMPLEMENTED if not registry.get(n).impl.default.own_vjp)


def is_float(x, quantized=False):
  dtype = jnp.dtype(x.dtype)
  return jnp.issubdtype(dtype, jnp.floating) and (dtype.itemsize <= 1) == quantized


def op_at_cpu_size(name):
  """(op, inputs of its first record at smoke size, its constant axes)."""
  op = registry.get(name)
  w = next(iter(dataset.load_workloads(name)))
  plan = plan_lib.plan(op, w, size="smoke", seed=7, on_gpu=False, tuned=False)
  const = {**op.definition.const_axes, **{a: v for a, v in plan.axes_run.items() if a in op.definition.const_axes}}
  return op, plan.inputs, const


def loss_of(op, inputs, const, wrt, backend):
  """`sum(out * weights)` over the op's floating outputs, as a function of
  the inputs named `wrt`."""

  def f(*values):
    outs = op.name_outputs(
      dispatch.run(op.impl, {**inputs, **dict(zip(wrt, values))}, const_axes=const, backend=backend)
    )
    return sum(
      jnp.sum(o.astype(jnp.float32) * gradients.weights_like(o.shape, seed))
      for seed, o in enumerate(outs.values())
      if jnp.issubdtype(o.dtype, jnp.floating)
    )

  return f


@pytest.mark.parametrize("name", THROUGH_REFERENCE)
def test_pallas_gradient_is_the_xla_gradient_or_a_clear_error(name):
  op, inputs, const = op_at_cpu_size(name)
  wrt = [k for k, v in inputs.items() if is_float(v)]
  outputs_float = any(jnp.issubdtype(jnp.dtype(t.np_dtype), jnp.floating) for t in op.definition.outputs.values())
  if not (wrt and outputs_float):
    pytest.skip(f"{name}: no floating input of 16 bits or more, or no floating output: nothing to differentiate")
  args = tuple(inputs[k] for k in wrt)
  argnums = tuple(range(len(wrt)))
  grad = lambda backend: jax.jit(jax.grad(loss_of(op, inputs, const, wrt, backend), argnums))  # noqa: E731
  try:
    want = grad("xla")(*args)
  except Exception:
    # The reference has no gradient: the Pallas path says so, naming the op.
    with pytest.raises(NotDifferentiableError, match=f"{kit.family_of(name)}.* is not differentiable"):
      grad("pallas")(*args)
    return
  names = gradients.pallas_calls(jax.grad(loss_of(op, inputs, const, wrt, "pallas"), argnums), *args)
  assert names, f"{name}: no pallas_call in the Pallas path's gradient"
  got = grad("pallas")(*args)
  gradients.assert_grads_close(got, want, wrt)
  assert any(float(jnp.abs(g.astype(jnp.float32)).max()) > 0 for g in want), (name, "every gradient is zero")


QUANTIZED = [
  n
  for n in first_of_each_family(IMPLEMENTED)
  if any(
    jnp.issubdtype(jnp.dtype(t.np_dtype), jnp.floating) and jnp.dtype(t.np_dtype).itemsize <= 1
    for t in registry.get(n).definition.inputs.values()
  )
]


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_inputs_raise_naming_the_op_and_the_input(name, backend):
  op, inputs, const = op_at_cpu_size(name)
  for key in (k for k, v in inputs.items() if is_float(v, quantized=True)):
    f = loss_of(op, inputs, const, [key], backend)
    with pytest.raises(
      NotDifferentiableError, match=f"{kit.family_of(name)}.* not differentiable with respect to '{key}'.*quantized"
    ):
      jax.make_jaxpr(jax.grad(f))(inputs[key])


def test_there_are_quantized_inputs_and_ops_through_their_references():
  assert QUANTIZED and len(THROUGH_REFERENCE) >= 5, (QUANTIZED, THROUGH_REFERENCE)
