"""The input contract of `jaxkern.ops`: one validation per op, run before
dispatch on every backend (`xla` included), and the signature rules.

Each public op is wrapped by `public_op(validate, ...)`: before the op's
body (and so before any backend is chosen) `validate` receives the call's
arguments by name and raises `InputError` where a tensor's rank, shape or
dtype (or a non-tensor argument) breaks the op's documented contract. A
model developed on the XLA path therefore fails the same way, with the
same message, on the Pallas path. What the contract does not say (a
kernel's tile or dtype limits, e.g. the Mosaic GPU kernels' bf16-only
forward) stays with the kernel: it refuses with `Unsupported` (the
`"pallas"` backend falls back) or a message naming the backend.

Signatures: tensors are positional, everything else keyword-only; the
softmax scale is `sm_scale` everywhere, default None = D**-0.5 with D the
head dim of q. Spellings of the previous release keep working for one
release with a `DeprecationWarning` (`public_op`'s `was_positional` and
`renamed`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# The release after which the deprecated spellings stop working.
REMOVED_IN = "0.3.0"


class InputError(ValueError, TypeError):
  """An argument of a `jaxkern.ops` op breaks the op's contract.

  `op`, `argument`, `expected`, `got`: the op's name, the argument, what the
  contract requires and what the call passed; the message reads
  `"<op>: <argument> must be <expected>, got <got>"`. Both a ValueError and
  a TypeError, so either `except` clause catches it; the same on every
  backend."""

  def __init__(self, op: str, argument: str, expected: str, got: str):
    self.op, self.argument, self.expected, self.got = op, argument, expected, got
    super().__init__(f"{op}: {argument} must be {expected}, got {got}")

  def __reduce__(self):
    return type(self), (self.op, self.argument, self.expected, self.got)


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(np.shape(x))


def _dtype(x: Any) -> np.dtype:
  dtype = getattr(x, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.asarray(x).dtype


def _is_floating(dtype: np.dtype) -> bool:
  import jax.numpy as jnp  # ml_dtypes' float8 / bfloat16 are floating to jnp, not to numpy

  return bool(jnp.issubdtype(dtype, jnp.floating))


def _is_integer(dtype: np.dtype) -> bool:
  return np.issubdtype(dtype, np.integer)


def _dims(shape: Sequence[object]) -> str:
  return "[" + ", ".join(map(str, shape)) + "]"


class Checks:
  """The checks of one op call, raising `InputError` named for `op`.

  Layouts are written like the docstrings (`"[B, Nq, H, D]"`); a check
  returns nothing and raises at the first violation, so a validator lists
  them in the order a reader checks a call: ranks, then the axes two
  arguments share, then dtypes."""

  def __init__(self, op: str):
    self.op = op

  def fail(self, argument: str, expected: str, got: str) -> None:
    raise InputError(self.op, argument, expected, got)

  def array(self, name: str, x: Any) -> None:
    """`x` has a shape and a dtype (a jax or numpy array, a tracer)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      self.fail(name, "an array", type(x).__name__)

  def rank(self, name: str, x: Any, layout: str, rank: int | None = None, *, at_least: int | None = None) -> None:
    """`x` is an array of rank `rank` (or at least `at_least`), laid out as `layout`."""
    self.array(name, x)
    ndim = len(_shape(x))
    if (rank is not None and ndim != rank) or (at_least is not None and ndim < at_least):
      self.fail(name, f"{layout} (rank {rank if rank is not None else f'>= {at_least}'})", f"shape {_shape(x)}")

  def shape(self, name: str, x: Any, expected: Sequence[int | None], layout: str, why: str = "") -> None:
    """`x` has shape `expected` (None: any size there); `layout` names the
    axes, `why` where the sizes come from."""
    self.array(name, x)
    shape = _shape(x)
    if len(shape) != len(expected) or any(e is not None and e != s for e, s in zip(expected, shape)):
      sizes = _dims(["*" if e is None else e for e in expected])
      self.fail(name, f"{layout} = {sizes}" + (f" ({why})" if why else ""), f"shape {shape}")

  def dtype(self, name: str, x: Any, allowed: Sequence[Any]) -> None:
    """`x`'s dtype is one of `allowed`."""
    allowed = [np.dtype(d) for d in allowed]
    if _dtype(x) not in allowed:
      self.fail(name, " or ".join(d.name for d in allowed), _dtype(x).name)

  def floating(self, name: str, x: Any) -> None:
    if not _is_floating(_dtype(x)):
      self.fail(name, "a floating dtype", _dtype(x).name)

  def integer(self, name: str, x: Any) -> None:
    if not _is_integer(_dtype(x)):
      self.fail(name, "an integer dtype (int32)", _dtype(x).name)

  def boolean_or_integer(self, name: str, x: Any) -> None:
    dtype = _dtype(x)
    if not (dtype == np.bool_ or _is_integer(dtype)):
      self.fail(name, "bool (or an integer dtype)", dtype.name)

  def same_dtype(self, name: str, x: Any, like_name: str, like: Any) -> None:
    """`x` has the dtype of `like`."""
    if _dtype(x) != _dtype(like):
      self.fail(name, f"{like_name}'s dtype {_dtype(like).name}", _dtype(x).name)

  def scalar(self, name: str, x: Any, *, optional: bool = False) -> None:
    """`x` is a 0-d value (a Python number or a 0-d array; None if `optional`)."""
    if x is None and optional:
      return
    if x is None or isinstance(x, (str, bytes)) or not (_is_floating(_dtype(x)) or _is_integer(_dtype(x))):
      self.fail(name, "a real scalar" + (" or None" if optional else ""), repr(x) if x is None else type(x).__name__)
    if _shape(x) != ():
      self.fail(name, "a scalar (shape ())", f"shape {_shape(x)}")

  def multiple(self, name: str, value: int, of: int, what: str) -> None:
    """`value` (an axis of `name`) is a multiple of `of`."""
    if of <= 0 or value % of:
      self.fail(name, f"{what} a multiple of {of}", str(value))


Validator = Callable[..., None]


def public_op(
  validate: Validator,
  *,
  was_positional: Sequence[str] = (),
  renamed: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Wraps a public op: the previous release's spellings mapped to the
  current ones with a `DeprecationWarning`, then `validate(**arguments)`
  (every parameter bound by name, defaults applied), then the op.

  `was_positional`: keyword-only parameters that the previous release took
  positionally after the tensors, in that order (an extra positional
  argument is passed as the next of them); `renamed`: old keyword -> new
  keyword. Both are accepted until `REMOVED_IN`."""
  renamed = dict(renamed or {})

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = fn.__name__

    @functools.wraps(fn)
    def op(*args, **kwargs):
      if len(args) > len(positional):
        extra = args[len(positional) :]
        if len(extra) > len(was_positional):
          raise TypeError(
            f"{name}() takes {len(positional)} positional arguments (the tensors) but {len(args)} were given; "
            "pass everything else by keyword"
          )
        moved = list(was_positional[: len(extra)])
        for key, value in zip(moved, extra):
          if key in kwargs:
            raise TypeError(f"{name}() got multiple values for argument {key!r}")
          kwargs[key] = value
        args = args[: len(positional)]
        warnings.warn(
          f"jaxkern.ops.{name}: passing {', '.join(moved)} positionally is deprecated and stops working in "
          f"jaxkern {REMOVED_IN}; pass {', '.join(f'{k}=...' for k in moved)} by keyword",
          DeprecationWarning,
          stacklevel=2,
        )
      for old, new in renamed.items():
        if old in kwargs:
          if new in kwargs:
            raise TypeError(f"{name}() got both {old}= (deprecated) and {new}=")
          kwargs[new] = kwargs.pop(old)
          warnings.warn(
            f"jaxkern.ops.{name}: {old}= is deprecated and stops working in jaxkern {REMOVED_IN}; use {new}=",
            DeprecationWarning,
            stacklevel=2,
          )
      bound = sig.bind(*args, **kwargs)
      bound.apply_defaults()
      validate(**bound.arguments)
      return fn(*args, **kwargs)

    op.validate = validate  # type: ignore[attr-defined]
    return op

  return wrap
