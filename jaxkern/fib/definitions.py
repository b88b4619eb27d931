"""Definitions both ways: ours as FlashInfer-Bench 0.1.2 definitions (FIB
dtypes, a `reference` that is Python source defining `run`), and FIB
definitions matched to ours by their math and written back in our form.

A FIB definition matches one of ours when the op_type, the axes (names and
var/const kinds), and the inputs and outputs (names in order, shapes as axis
names, dtypes by `formats.dtype_matches`) agree. Equal constant values make
the match exact; other values are the same family at another shape (a
definition JSON of ours needs no code for that). The pointer to our jnp
function travels in `jaxkern_reference`, a field FIB ignores.
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Mapping
from typing import Any

from jaxkern import dataset
from jaxkern.dataset import constraints as constraint_lang
from jaxkern.fib import formats

POINTER_FIELD = "jaxkern_reference"


def _check_identifier(d: dataset.Definition, name: str) -> None:
  if not name.isidentifier() or keyword.iskeyword(name):
    raise dataset.DatasetError(
      "an input name must be a Python identifier (it is a parameter of `run`)",
      file=d.name,
      field=f"inputs.{name}",
      expected="a Python identifier",
      got=name,
    )


def reference_source(d: dataset.Definition) -> str:
  """The FIB `reference` of `d`: Python source whose `run(<inputs>)` returns
  our jnp reference's outputs as torch tensors (one, or a tuple in output
  order) through `jaxkern.fib.bridge`. It needs jax and jaxkern where it runs."""
  for name in d.inputs:
    _check_identifier(d, name)
  params = ", ".join(d.inputs)
  return (
    f'"""{d.name}: jaxkern\'s jnp reference ({d.reference}),\n'
    "called on FIB's torch tensors through jaxkern.fib.bridge (bytes cross as\n"
    'they are; needs jax and jaxkern installed where this runs)."""\n'
    "from jaxkern.fib import bridge\n\n\n"
    f"def run({params}):\n"
    f"  return bridge.run_reference_torch({d.name!r}, {params})\n"
  )


def _tensors_to_fib(specs: Mapping[str, dataset.TensorSpec]) -> dict[str, Any]:
  return {
    n: {
      "shape": None if s.shape is None else list(s.shape),
      "dtype": formats.fib_dtype(s),
      "description": s.description,
    }
    for n, s in specs.items()
  }


def to_fib(d: dataset.Definition) -> dict[str, Any]:
  """`d` as a FIB 0.1.2 Definition object (JSON-ready)."""
  axes = {}
  for n, a in d.axes.items():
    axes[n] = {"type": "const", "value": a.value} if a.is_const else {"type": "var"}
    axes[n]["description"] = a.description
  return {
    "name": d.name,
    "op_type": d.op_type,
    "description": d.description,
    "tags": list(d.tags),
    "axes": axes,
    "inputs": _tensors_to_fib(d.inputs),
    "outputs": _tensors_to_fib(d.outputs),
    "constraints": list(d.constraints),
    "reference": reference_source(d),
    POINTER_FIELD: d.reference,
  }


# -- matching -------------------------------------------------------------


def structural_differences(fib: Mapping[str, Any], ours: dataset.Definition) -> list[str]:
  """How a FIB definition's math differs from ours (empty: the same op, up to
  constant values), one phrase per difference."""
  diffs = []
  if fib.get("op_type") != ours.op_type:
    diffs.append(f"op_type {fib.get('op_type')!r} (ours {ours.op_type!r})")
  fib_axes = fib.get("axes") or {}
  kinds = {n: a.type for n, a in ours.axes.items()}
  fib_kinds = {n: (a or {}).get("type") for n, a in fib_axes.items()}
  if fib_kinds != kinds:
    diffs.append(f"axes {fib_kinds} (ours {kinds})")
  for kind, specs in (("inputs", ours.inputs), ("outputs", ours.outputs)):
    theirs = fib.get(kind) or {}
    if list(theirs) != list(specs):
      diffs.append(f"{kind} {list(theirs)} (ours {list(specs)})")
      continue
    for name, spec in specs.items():
      t = theirs[name] or {}
      shape = None if spec.shape is None else list(spec.shape)
      if t.get("shape") != shape:
        diffs.append(f"{kind}.{name}.shape {t.get('shape')} (ours {shape})")
      if not formats.dtype_matches(t.get("dtype"), spec):
        diffs.append(f"{kind}.{name}.dtype {t.get('dtype')!r} (ours {formats.fib_dtype(spec)!r})")
  return diffs


def constant_differences(fib: Mapping[str, Any], ours: dataset.Definition) -> dict[str, tuple[Any, int]]:
  """Constant axes whose FIB value differs from ours: name -> (FIB's, ours)."""
  fib_axes = fib.get("axes") or {}
  return {
    n: ((fib_axes.get(n) or {}).get("value"), v)
    for n, v in ours.const_axes.items()
    if (fib_axes.get(n) or {}).get("value") != v
  }


@dataclasses.dataclass(frozen=True)
class Match:
  """The outcome of matching one FIB definition: `ours` is the definition of
  ours with the same math (None: no family implements it), `constants` the
  constant axes that differ from it, `message` one line for the user."""

  name: str
  ours: dataset.Definition | None
  constants: dict[str, tuple[Any, int]]
  message: str

  @property
  def exact(self) -> bool:
    return self.ours is not None and not self.constants


def match(fib: Mapping[str, Any], ours: Mapping[str, dataset.Definition]) -> Match:
  """The definition of ours with `fib`'s math, preferring equal constants,
  then the same name, then the same `jaxkern_reference`."""
  name = str(fib.get("name"))
  same = [d for d in ours.values() if not structural_differences(fib, d)]
  if same:
    best = min(
      same,
      key=lambda d: (len(constant_differences(fib, d)), d.name != name, d.reference != fib.get(POINTER_FIELD), d.name),
    )
    consts = constant_differences(fib, best)
    how = (
      "the same math and constants as"
      if not consts
      else "the same math as "
      + best.name
      + " with other constants "
      + ", ".join(f"{a}={v} (ours {o})" for a, (v, o) in consts.items())
      + "; family of"
    )
    return Match(name, best, consts, f"{name}: {how} {best.name if not consts else best.reference}")
  pool = [d for d in ours.values() if d.op_type == fib.get("op_type")] or list(ours.values())
  closest = min(pool, key=lambda d: (len(structural_differences(fib, d)), d.name))
  diffs = structural_differences(fib, closest)
  return Match(
    name,
    None,
    {},
    f"{name} (op_type {fib.get('op_type')!r}): no jaxkern family implements it; "
    f"closest is {closest.name}, which differs in: " + "; ".join(diffs),
  )


def _parses(expr: str) -> bool:
  try:
    constraint_lang.names(expr)
  except ValueError:
    return False
  return True


def to_ours(fib: Mapping[str, Any], m: Match) -> tuple[dict[str, Any], list[str]]:
  """A matched FIB definition in our JSON form, and its constraints our
  constraint language cannot read (left out; the caller reports them).

  Name, op_type, description, tags and axes are FIB's; tensors take our
  matched definition's dtypes and descriptions (they say what the bytes
  are); constraints are ours plus FIB's that we can evaluate; `reference`
  names our family's jnp function."""
  assert m.ours is not None
  ours = m.ours.raw
  axes = {}
  for n, a in (fib.get("axes") or {}).items():
    axes[n] = {
      "type": a["type"],
      **({"value": a["value"]} if a["type"] == "const" else {}),
      "description": a.get("description") or ours["axes"][n].get("description", ""),
    }
  theirs = [c for c in fib.get("constraints") or [] if c not in ours.get("constraints", [])]
  unread = [c for c in theirs if not _parses(c)]
  out = {
    "name": fib["name"],
    "op_type": fib["op_type"],
    "description": fib.get("description") or "",
    "tags": list(fib.get("tags") or []),
    "axes": axes,
    "inputs": ours["inputs"],
    "outputs": ours["outputs"],
    "constraints": list(ours.get("constraints", [])) + [c for c in theirs if c not in unread],
    "reference": m.ours.reference,
  }
  return out, unread
