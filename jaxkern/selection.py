"""Which workloads a run covers: by definition (names or prefixes), variant,
uuid, and caps per definition and per variant; in dataset order (or
interleaved across definitions, `interleave`). Malformed records and files
of unknown definitions go to an error sink and the rest still load. Also
where a definition's recorded data is largest (`largest_recorded_axes`: the
default axes of lowering checks, compile reports and sweeps)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Iterable, Mapping

import numpy as np

from jaxkern import dataset


def csv(text: str | None) -> list[str]:
  return [x.strip() for x in str(text or "").split(",") if x.strip()]


def parse_axes(text: str) -> dict[str, int]:
  """'M=4096,N=8' -> {'M': 4096, 'N': 8}; ValueError naming the bad part."""
  axes = {}
  for part in csv(text):
    name, sep, value = part.partition("=")
    if not sep or not value.strip().isdigit():
      raise ValueError(f"--axes: expected NAME=INT pairs, got {part!r}")
    axes[name.strip()] = int(value)
  return axes


def input_bytes(definition: dataset.Definition, axes: Mapping[str, int]) -> int:
  """Bytes of all inputs of `definition` at `axes` (var axes suffice)."""
  full = definition.full_axes(axes)
  return sum(math.prod(t.concrete_shape(full)) * np.dtype(t.np_dtype).itemsize for t in definition.inputs.values())


def largest_recorded_axes(
  definition: dataset.Definition, dataset_dir: str | os.PathLike | None = None
) -> dict[str, int]:
  """The recorded var axes of `definition` with the most input bytes (ties:
  the first record). ValueError without a record."""
  best, best_bytes = None, -1
  for w in dataset.load_workloads(definition.name, dataset_dir, definitions={definition.name: definition}):
    n = input_bytes(definition, w.axes)
    if n > best_bytes:
      best, best_bytes = dict(w.axes), n
  if best is None:
    raise ValueError(f"{definition.name}: no recorded workload")
  return best


@dataclasses.dataclass(frozen=True)
class Selection:
  definitions: tuple[str, ...] = ()  # names or prefixes; empty = all
  variants: tuple[str, ...] = ()  # recorded variants ("none" = records without one); empty = all
  uuids: tuple[str, ...] = ()
  max_per_definition: int = 0  # 0 = no cap
  max_per_variant: int = 0  # 0 = no cap; records without a variant form one group


def select_workloads(
  dataset_dir: str | pathlib.Path, sel: Selection, on_error: dataset.ErrorSink, skip_uuids: Iterable[str] = ()
) -> list[dataset.Workload]:
  """The selected workloads. Raises ValueError for a missing dataset or a
  definition filter that matches nothing."""
  ddir = pathlib.Path(dataset_dir)
  if not (ddir / "definitions").is_dir():
    raise ValueError(f"dataset directory {ddir} has no definitions/ folder")
  defs = dataset.load_definitions(ddir)
  for w in sel.definitions:
    if not any(n.startswith(w) for n in defs):
      raise ValueError(f"definitions: no definition matches {w!r}; close matches: {dataset.close_matches(w, defs)}")
  keep = lambda n: not sel.definitions or any(n.startswith(w) for w in sel.definitions)  # noqa: E731
  variants, uuids, skip = set(sel.variants), set(sel.uuids), set(skip_uuids)
  seen: set[str] = set()
  selected = []
  for path in sorted((ddir / "workloads").glob("*.jsonl")):
    if not keep(path.stem):
      continue
    if path.stem not in defs:
      on_error(
        dataset.DatasetError(
          "workload file of an unknown definition", file=path, expected=f"definitions/{path.stem}.json", got=path.name
        )
      )
      continue
    per_variant: dict[str, int] = {}
    n_def = 0
    for w in dataset.iter_jsonl(path, defs, on_error=on_error, seen_uuids=seen, expect_definition=path.stem):
      variant = str(w.variant).lower() if w.variant is not None else "none"
      if variants and variant not in variants and str(w.variant) not in variants:
        continue
      if uuids and w.uuid not in uuids:
        continue
      if sel.max_per_definition and n_def >= sel.max_per_definition:
        continue
      if sel.max_per_variant and per_variant.get(variant, 0) >= sel.max_per_variant:
        continue
      per_variant[variant] = per_variant.get(variant, 0) + 1
      n_def += 1
      if w.uuid not in skip:
        selected.append(w)
  return selected


ORDERS = ("dataset", "interleave")


def interleave(workloads: Iterable[dataset.Workload]) -> list[dataset.Workload]:
  """Round robin over definitions (each keeps its own order): the first
  workload of every definition, then the second of every one, and so on, so
  that a run stopped by a time budget has covered every definition early."""
  by_def: dict[str, list[dataset.Workload]] = {}
  for w in workloads:
    by_def.setdefault(w.definition, []).append(w)
  queues = list(by_def.values())
  return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
