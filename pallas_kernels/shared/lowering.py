"""Deviceless lowering for an abstract H100 and the parsers of the kernel
launches a lowered module holds, one per backend: Triton calls
(`__gpu$xla.gpu.triton`, with name, grid, warps and stages) and Mosaic GPU
calls (`mosaic_gpu_v2`, with operand and result types and the kernel's hash)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax

from pallas_kernels.shared.device import DEFAULT_NUM_SMS


def abstract_h100_mesh():
  """A one-device mesh of an abstract H100 with its SM count (Mosaic GPU's
  lowering reads it; Triton's does not)."""
  from jax._src import mesh as mesh_lib

  return mesh_lib.AbstractMesh(
    (1,),
    ("x",),
    (mesh_lib.AxisType.Explicit,),
    abstract_device=mesh_lib.AbstractDevice("NVIDIA H100", DEFAULT_NUM_SMS, "cuda"),
  )


def lower_for_h100(fn: Callable[..., Any], *avals: Any, **static_kwargs: Any) -> str:
  """Lowers `fn(*avals, **static_kwargs)` for CUDA without a GPU; returns the
  StableHLO text. Raises if the Pallas kernel cannot be lowered (bad block
  shapes, unsupported casts or primitives)."""
  f = functools.partial(fn, **static_kwargs)
  with jax.sharding.use_abstract_mesh(abstract_h100_mesh()):
    lowered = jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


@dataclasses.dataclass(frozen=True, order=True)
class TritonCall:
  """One `__gpu$xla.gpu.triton` custom call of a lowered module: the kernel
  (`pallas_call(name=...)`) and the launch XLA will make of it."""

  name: str
  grid: tuple[int, int, int]
  num_warps: int
  num_stages: int


_TRITON_CALL = re.compile(r'stablehlo\.custom_call @"?__gpu\$xla\.gpu\.triton"?\(')
# The serialized kernel IR: a quoted string of escaped bytes, dropped before
# the launch fields are read so that nothing inside it can match.
_IR_FIELD = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')
_NAME_FIELD = re.compile(r'\bname = "((?:[^"\\]|\\.)*)"')


def _int_field(text: str, name: str) -> int:
  match = re.search(rf"\b{name} = (-?\d+) : i32", text)
  if match is None:
    raise ValueError(f"Triton call without {name}: {text[:200]}")
  return int(match.group(1))


def _call_lines(stablehlo: str, call: re.Pattern) -> list[str]:
  """The lines of a lowered module's text holding a `call` custom call."""
  return [line for line in stablehlo.splitlines() if call.search(line)]


def _triton_name(line: str) -> str:
  name = _NAME_FIELD.search(_IR_FIELD.sub("", line))
  return name.group(1) if name else ""


def triton_calls(stablehlo: str) -> list[TritonCall]:
  """The Triton calls of a lowered module's text (`lower_for_h100`), in
  text order: name, grid (x, y, z), num_warps, num_stages."""
  calls = []
  for line in _call_lines(stablehlo, _TRITON_CALL):
    fields = _IR_FIELD.sub("", line)
    calls.append(
      TritonCall(
        name=_triton_name(line),
        grid=(_int_field(fields, "grid_x"), _int_field(fields, "grid_y"), _int_field(fields, "grid_z")),
        num_warps=_int_field(fields, "num_warps"),
        num_stages=_int_field(fields, "num_stages"),
      )
    )
  return calls


@dataclasses.dataclass(frozen=True, order=True)
class MosaicGpuCall:
  """One `mosaic_gpu_v2` custom call of a lowered module: its operand and
  result tensor types as written (`tensor<2x128xf32>`); the kernel itself
  is serialized bytecode, so the types are what the text tells.
  `kernel_hash`: the call's `kernel_hash` as written (escaped bytes; equal
  for calls of the same kernel, which the CUDA plugin compiles once per
  process); not part of equality."""

  operands: tuple[str, ...]
  results: tuple[str, ...]
  kernel_hash: str = dataclasses.field(default="", compare=False)


_MOSAIC_GPU_CALL = re.compile(r'stablehlo\.custom_call @"?mosaic_gpu_v2"?\(')
_SIGNATURE = re.compile(r"\}\s*:\s*\(([^)]*)\)\s*->\s*(.+)$")
_TENSOR = re.compile(r"tensor<[^>]*>")
# Every quoted string (the kernel's bytecode, its hash), dropped before the signature is read.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_KERNEL_HASH = re.compile(r'\bkernel_hash = "((?:[^"\\]|\\.)*)"')


def _signature(line: str, kind: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(operand types, result types) of the custom call on `line`."""
  signature = _SIGNATURE.search(_QUOTED.sub('""', line))
  if signature is None:
    raise ValueError(f"{kind} call without a type signature: {line[:200]}")
  return tuple(_TENSOR.findall(signature.group(1))), tuple(_TENSOR.findall(signature.group(2)))


def mosaic_gpu_calls(stablehlo: str) -> list[MosaicGpuCall]:
  """The Mosaic GPU calls of a lowered module's text (`lower_for_h100`), in
  text order."""
  calls = []
  for line in _call_lines(stablehlo, _MOSAIC_GPU_CALL):
    kernel_hash = _KERNEL_HASH.search(line)
    calls.append(
      MosaicGpuCall(*_signature(line, "Mosaic GPU"), kernel_hash=kernel_hash.group(1) if kernel_hash else "")
    )
  return calls


_ELEMENT_BYTES = {
  "i1": 1,
  "i8": 1,
  "ui8": 1,
  "f8E4M3FN": 1,
  "f8E5M2": 1,
  "f8E4M3FNUZ": 1,
  "f8E5M2FNUZ": 1,
  "f4E2M1FN": 0.5,
  "i16": 2,
  "bf16": 2,
  "f16": 2,
  "i32": 4,
  "ui32": 4,
  "f32": 4,
  "i64": 8,
  "f64": 8,
}


def tensor_bytes(tensor_type: str) -> float:
  """Bytes of one `tensor<2x128xf32>` type (a 0-d `tensor<f32>` too)."""
  *dims, element = tensor_type[len("tensor<") : -1].split("x")
  if element not in _ELEMENT_BYTES:
    raise ValueError(f"unknown element type in {tensor_type}")
  size = _ELEMENT_BYTES[element]
  for dim in dims:
    size *= int(dim)
  return size


@dataclasses.dataclass(frozen=True)
class TritonBuffers:
  """The buffers of one Triton call: its name and the bytes of its operands
  and results (whole buffers: an upper bound on what the kernel reads and
  writes, exact where every element is touched once)."""

  name: str
  operand_bytes: float
  result_bytes: float


def triton_buffers(stablehlo: str) -> list[TritonBuffers]:
  """Operand and result sizes of the Triton calls of a lowered module's text
  (`lower_for_h100`), in text order."""
  calls = []
  for line in _call_lines(stablehlo, _TRITON_CALL):
    operands, results = (sum(map(tensor_bytes, types)) for types in _signature(line, "Triton"))
    calls.append(TritonBuffers(_triton_name(line), operands, results))
  return calls


def assert_lowers_to_triton(fn: Callable[..., Any], *avals: Any, **static_kwargs: Any) -> str:
  txt = lower_for_h100(fn, *avals, **static_kwargs)
  if not triton_calls(txt):
    raise AssertionError("lowering produced no Triton custom call")
  return txt
