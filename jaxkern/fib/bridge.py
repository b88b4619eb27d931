"""Running our references and kernels on FlashInfer-Bench's torch tensors:
what the exported definitions' `reference` and the exported solutions'
sources call.

Tensors cross by their bytes: a torch tensor is viewed as the unsigned
integer of its element width, handed to numpy, and viewed as our dtype
(`ml_dtypes` for bfloat16 and float8), so bf16, float8, packed FP4 and int8
byte tensors arrive bit for bit; outputs go back the same way as the FIB
dtype of the definition's output, on the device of the first input tensor.
Python scalars become 0-d arrays of the input's dtype. torch is imported
only by the `*_torch` functions (FIB's process has it; ours need not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxkern import registry, tuning
from jaxkern.fib import formats

_UINT_BY_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def to_our_array(value: Any, spec) -> np.ndarray:
  """One input (a numpy array of any dtype of the same element width, or a
  Python scalar) as our dtype `spec.np_dtype`: bytes reinterpreted, except
  FIB's int64 for our int32, which is range-checked and converted."""
  want = spec.np_dtype
  if not isinstance(value, np.ndarray):
    return np.asarray(value, want)
  if value.dtype == want:
    return value
  if spec.dtype == "int32" and value.dtype == np.int64:
    if value.size and (value.min() < np.iinfo(np.int32).min or value.max() > np.iinfo(np.int32).max):
      raise ValueError(f"input {spec.name}: int64 values outside int32")
    return value.astype(np.int32)
  if value.dtype.itemsize != want.itemsize:
    raise ValueError(
      f"input {spec.name}: {value.dtype} ({value.dtype.itemsize} bytes) cannot be read as "
      f"{spec.dtype} ({want.itemsize} bytes)"
    )
  return np.ascontiguousarray(value).view(want)


def run_reference(name: str, *args: Any) -> tuple[np.ndarray, ...]:
  """Our jnp reference of definition `name` on numpy inputs in definition
  order; its outputs in definition order, as numpy arrays of our dtypes."""
  op = registry.get(name)
  return _run(op, args, lambda inputs: op.reference(inputs))


def run_kernel(
  name: str, config: Mapping[str, Any] | None, *args: Any, backend: str | None = None
) -> tuple[np.ndarray, ...]:
  """Our Pallas kernel of definition `name` on `backend` (None: the op's
  best available) with `config` (a config's JSON; None: the op's own
  choice) on numpy inputs in definition order."""
  op = registry.get(name)

  def call(inputs):
    chosen = None
    if config is not None:
      chosen = tuning.config_from_json(config, op.kernel_of(backend).config_class())
    return op.kernel(inputs, config=chosen, backend=backend)

  return _run(op, args, call)


def _run(op: registry.Op, args: Sequence[Any], fn) -> tuple[np.ndarray, ...]:
  import jax.numpy as jnp

  specs = list(op.definition.inputs.values())
  if len(args) != len(specs):
    raise TypeError(f"{op.name}: expected {len(specs)} inputs {[s.name for s in specs]}, got {len(args)}")
  inputs = {s.name: jnp.asarray(to_our_array(a, s)) for s, a in zip(specs, args)}
  out = fn(inputs)
  return tuple(np.asarray(out[name]) for name in op.definition.outputs)


# -- torch side -----------------------------------------------------------


def torch_to_numpy(t: Any) -> Any:
  import torch  # pyright: ignore[reportMissingImports] (FIB's side: not a jaxkern dependency)

  if not isinstance(t, torch.Tensor):
    return t
  t = t.detach().cpu().contiguous()
  # numpy has no bfloat16 / float8 / float4: those cross as their bytes.
  if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2):
    unsigned = {1: torch.uint8, 2: torch.int16}[t.element_size()]
    return t.view(unsigned).numpy().view(_UINT_BY_WIDTH[t.element_size()])
  return t.numpy()


def _numpy_to_torch(x: np.ndarray, fib_dtype: str, device: Any) -> Any:
  import torch  # pyright: ignore[reportMissingImports] (FIB's side: not a jaxkern dependency)

  target = torch.float4_e2m1fn_x2 if fib_dtype == "float4_e2m1" else getattr(torch, fib_dtype)
  x = np.ascontiguousarray(x)
  if x.dtype == np.bool_:
    t = torch.from_numpy(x)
  else:
    signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[x.dtype.itemsize]
    t = torch.from_numpy(x.view(signed).copy()).view(target)
  return t.to(device)


def _torch_call(name: str, args: Sequence[Any], run) -> Any:
  import torch  # pyright: ignore[reportMissingImports] (FIB's side: not a jaxkern dependency)

  op = registry.get(name)
  device = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
  outs = run(*(torch_to_numpy(a) for a in args))
  tensors = tuple(
    _numpy_to_torch(x, formats.fib_dtype(spec), device) for x, spec in zip(outs, op.definition.outputs.values())
  )
  return tensors[0] if len(tensors) == 1 else tensors


def run_reference_torch(name: str, *args: Any) -> Any:
  """`run_reference` on torch tensors (or Python scalars) in definition
  order: one torch tensor, or a tuple in output order, as FIB's
  value-returning `run` returns them."""
  return _torch_call(name, args, lambda *a: run_reference(name, *a))


def run_kernel_torch(name: str, config: Mapping[str, Any] | None, *args: Any, backend: str | None = None) -> Any:
  """`run_kernel` on torch tensors, returning as `run_reference_torch`."""
  return _torch_call(name, args, lambda *a: run_kernel(name, config, *a, backend=backend))
