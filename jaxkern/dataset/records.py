"""The typed records of a dataset: definitions (axes, tensors, constraints),
workloads, and the one error type every bad record or definition raises."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, dataclass_transform

import chex
import ml_dtypes
import numpy as np

from jaxkern.dataset import constraints

NP_DTYPES = {
  "bfloat16": np.dtype(ml_dtypes.bfloat16),
  "float32": np.dtype(np.float32),
  "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
  "uint8": np.dtype(np.uint8),
  "int32": np.dtype(np.int32),
  "bool": np.dtype(np.bool_),
}
DTYPES = tuple(NP_DTYPES)
# Fields every workload record must carry; everything else is provenance.
CORE_FIELDS = ("uuid", "definition", "axes")


class DatasetError(ValueError):
  """A record or definition that does not satisfy the contract.

  The message names the file, line, field and what was expected."""

  def __init__(
    self,
    message: str,
    *,
    file: str | os.PathLike | None = None,
    line: int | None = None,
    field: str | None = None,
    expected: Any = None,
    got: Any = None,
  ):
    self.file = None if file is None else str(file)
    self.line, self.field, self.expected, self.got = line, field, expected, got
    self.detail = message
    where = self.file or "<record>"
    if line is not None:
      where += f":{line}"
    parts = [where + ":"]
    if field:
      parts.append(f"field '{field}':")
    parts.append(message)
    if expected is not None:
      parts.append(f"(expected {expected}, got {got!r})")
    super().__init__(" ".join(parts))


@dataclass_transform(frozen_default=True)
def _record[T](cls: type[T]) -> type[T]:
  """A frozen chex dataclass (a JAX pytree, not a Mapping). The wrapper only
  types it: pyright honours chex's `dataclass_transform` on the bare
  decorator, not on the call with arguments."""
  return chex.dataclass(frozen=True, mappable_dataclass=False)(cls)


def is_count(v: Any) -> bool:
  """A non-negative int (bools are not counts)."""
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@_record
class AxisSpec:
  name: str
  type: str  # "var" or "const"
  value: int | None = None
  description: str = ""

  @property
  def is_const(self) -> bool:
    return self.type == "const"


@_record
class TensorSpec:
  name: str
  shape: tuple[str, ...] | None  # None: a Python scalar
  dtype: str
  description: str = ""

  @property
  def np_dtype(self) -> np.dtype:
    return NP_DTYPES[self.dtype]

  def concrete_shape(self, axes: Mapping[str, int]) -> tuple[int, ...]:
    return () if self.shape is None else tuple(int(axes[a]) for a in self.shape)


@_record
class Definition:
  name: str
  op_type: str
  description: str
  tags: tuple[str, ...]
  axes: dict[str, AxisSpec]
  inputs: dict[str, TensorSpec]
  outputs: dict[str, TensorSpec]
  constraints: tuple[str, ...]
  reference: str
  raw: dict

  @property
  def const_axes(self) -> dict[str, int]:
    # parse_definition gives every const axis a value.
    return {n: a.value for n, a in self.axes.items() if a.is_const and a.value is not None}

  @property
  def var_axes(self) -> tuple[str, ...]:
    return tuple(n for n, a in self.axes.items() if not a.is_const)

  def full_axes(self, axes: Mapping[str, int]) -> dict[str, int]:
    """`axes` completed with the constant axes, in definition order."""
    merged = {**self.const_axes, **axes}
    return {n: int(merged[n]) for n in self.axes if n in merged}

  def check_constraints(self, axes: Mapping[str, int]) -> list[str]:
    """The constraints that `axes` (all axes) violate."""
    return [c for c in self.constraints if not constraints.holds(c, axes)]


@_record
class Workload:
  uuid: str
  definition: str
  axes: dict[str, int]
  record: dict  # the whole recorded object, every field as recorded
  file: str = ""
  line: int = 0

  @property
  def variant(self) -> str | None:
    return self.record.get("variant")

  @property
  def provenance(self) -> dict:
    """Everything recorded beyond uuid, definition and axes."""
    return {k: v for k, v in self.record.items() if k not in CORE_FIELDS}
