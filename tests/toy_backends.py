"""A test-only family with two kernel backends (not a test file): `y = x * s`
on rows, as a Triton kernel and as a Mosaic GPU kernel (`plgpu.kernel`), so
that the backend seam (dispatch, fallback, tuned table, replay, sweep, kit)
is exercised on a real Mosaic GPU kernel before a family ships one.

The Mosaic GPU kernel takes float32 only (it refuses others with
`Unsupported`, which is how a dispatch falls back); the Triton kernel takes
any float dtype. Both share one config class, as backends of a family may.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkern.family import OpImpl
from pallas_kernels.shared import common
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.kernel import MOSAIC_GPU, TRITON, Kernel, Unsupported, kernels

NAME = "toy_scale_rows"
DEFINITION = {
  "name": NAME,
  "op_type": "toy",
  "description": "y = x * s",
  "tags": [],
  "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 128}},
  "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}, "s": {"shape": None, "dtype": "float32"}},
  "outputs": {"y": {"shape": ["M", "N"], "dtype": "float32"}},
  "constraints": ["M >= 1"],
  "reference": "toy_backends:toy_reference",
}
RECORDS = [{"uuid": "toy-0", "definition": NAME, "axes": {"M": 16}}]


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  """Rows per program (Triton) or per block of the grid (Mosaic GPU)."""

  block_rows: int = 8


def choose_config(shapes: Mapping[str, Any]) -> ToyConfig:
  return ToyConfig(8 if shapes["x"].shape[0] >= 8 else 1)


def candidate_configs(shapes: Mapping[str, Any]) -> list[ToyConfig]:
  return list(dict.fromkeys([choose_config(shapes), ToyConfig(1), ToyConfig(2)]))


def toy_reference(x, s):
  return x * s


def _check_rows(x: jax.Array, config: ToyConfig) -> None:
  if x.shape[0] % config.block_rows:
    raise ValueError(f"x has {x.shape[0]} rows, not a multiple of block_rows={config.block_rows}")


def triton_kernel(
  x: jax.Array, s: jax.Array, *, config: ToyConfig | None = None, interpret: bool | None = None
) -> jax.Array:
  """`x * s` on the Triton lowering, `block_rows` rows per program."""
  config = config or choose_config({"x": x})
  _check_rows(x, config)

  def body(s_ref, x_ref, y_ref):
    y_ref[...] = x_ref[...] * s_ref[0]

  rows = pl.BlockSpec((config.block_rows, x.shape[1]), lambda i: (i, 0))
  return common.pallas_call(
    body,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    grid=(x.shape[0] // config.block_rows,),
    in_specs=[pl.BlockSpec((1,), lambda i: (0,)), rows],
    out_specs=rows,
    name="toy_scale_rows",
    interpret=common.resolve_interpret(interpret),
  )(s.reshape(1).astype(x.dtype), x)


def mosaic_gpu_kernel(
  x: jax.Array, s: jax.Array, *, config: ToyConfig | None = None, interpret: bool | None = None
) -> jax.Array:
  """`x * s` as a Mosaic GPU kernel (`plgpu.kernel`, one block of
  `block_rows` rows per grid step); float32 only."""
  if x.dtype != jnp.float32:
    raise Unsupported(f"x must be float32 for the Mosaic GPU toy kernel, got {x.dtype}")
  config = config or choose_config({"x": x})
  _check_rows(x, config)
  rows = config.block_rows

  def body(s_ref, x_ref, y_ref):
    i = jax.lax.axis_index("rows")
    block = pl.ds(i * rows, rows)
    y_ref[block, :] = x_ref[block, :] * s_ref[...]

  launch = compat.kernel(
    body,
    name="toy_scale_rows",
    interpret=common.resolve_interpret(interpret),
    out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
    grid=(x.shape[0] // rows,),
    grid_names=("rows",),
  )
  return launch(jnp.broadcast_to(s.astype(x.dtype), (x.shape[1],)), x)


TRITON_KERNEL = Kernel(
  name=NAME,
  backend=TRITON,
  launch=triton_kernel,
  config_class=ToyConfig,
  choose_config=choose_config,
  candidate_configs=candidate_configs,
)
MOSAIC_GPU_KERNEL = Kernel(
  name=NAME,
  backend=MOSAIC_GPU,
  launch=mosaic_gpu_kernel,
  config_class=ToyConfig,
  choose_config=choose_config,
  candidate_configs=candidate_configs,
)


def make_inputs(axes, key, record):
  del record
  return {"x": jax.random.normal(key, (axes["M"], axes["N"]), jnp.float32), "s": jnp.asarray(3.0, jnp.float32)}


def cost(definition, axes, *, inputs=None, record=None, config=None):
  from jaxkern import roofline

  return roofline.Work(axes["M"] * axes["N"], roofline.io_bytes(definition, axes), "fp32")


IMPL = OpImpl(
  reference=toy_reference,
  kernels=kernels(TRITON_KERNEL, MOSAIC_GPU_KERNEL),
  make_inputs=make_inputs,
  cpu_axes=dict,
  cost=cost,
)
IMPLS = (IMPL,)


def launches_mosaic_gpu(config: ToyConfig, axes: Mapping[str, int]) -> list:
  """The Mosaic GPU calls the toy lowers to: one, with the scale row and x
  in, y out."""
  from pallas_kernels.shared.lowering import MosaicGpuCall

  del config
  m, n = axes["M"], axes["N"]
  return [MosaicGpuCall(operands=(f"tensor<{n}xf32>", f"tensor<{m}x{n}xf32>"), results=(f"tensor<{m}x{n}xf32>",))]
