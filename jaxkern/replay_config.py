"""The replay config schema: every field, its default and meaning.

`FIELDS` lists them; `default_config()` builds the `ConfigDict` that config
files in `configs/` start from (they change values), and any field is
overridable on the command line as `--config.FIELD=VALUE`.
`python -m jaxkern.replay --help` prints `fields_help()`.
(Kept apart from `jaxkern.replay` so config files do not import the app and
its flags.)
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from ml_collections import config_dict


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field: its name, default and meaning. A None default is a
  placeholder of type `placeholder` (a value or None may be given)."""

  name: str
  default: Any
  meaning: str
  placeholder: type | None = None


FIELDS: tuple[Field, ...] = (
  Field("dataset_dir", "", "the dataset folder; empty: the dataset shipped with the package"),
  Field("definitions", "", "comma-separated definition names or name prefixes; empty: all"),
  Field("variants", "", "comma-separated recorded variants; empty: all (`none`: records without one)"),
  Field("uuids", "", "comma-separated workload uuids; empty: all"),
  Field("max_workloads_per_definition", 0, "at most this many workloads per definition; 0: no cap"),
  Field(
    "max_workloads_per_variant",
    None,
    "at most this many per recorded variant (records without one form a group); 0: no cap; None: no cap on a "
    "GPU, 1 without one (interpret mode is slow; one per variant keeps every recorded structure)",
    int,
  ),
  Field("seed", 0, "input synthesis seed, mixed with each record's uuid"),
  Field(
    "scale", "auto", "run size: auto (recorded sizes on a GPU, the family's CPU budget without one) | full | smoke"
  ),
  Field("interpret", None, "run the kernels in interpret mode; None: when no GPU is present", bool),
  Field("blob_root", "", "the folder holding the records' recorded tensors (blob/... safetensors), if any"),
  Field(
    "output",
    "results/replay-{time}.jsonl",
    "the results file (JSONL); {time}: the run's start (20261205-143012), a new file per run; a fixed name "
    "that already holds results is only ever appended to (`resume`)",
  ),
  Field("tuned", True, "consult configs/tuned/<device kind>.json before the heuristic"),
  Field(
    "backend",
    "pallas",
    "kernel backend: pallas (the best available: the tuned table's, else the family's order) | triton | mosaic_gpu",
  ),
  Field(
    "resume",
    False,
    "append to `output`, skipping uuids already in it; without it an `output` holding results is an error",
  ),
  Field(
    "order",
    "dataset",
    "dataset | interleave (round robin over definitions: a time-capped run reaches every definition early)",
  ),
  Field("warmup", 1, "untimed calls before timing"),
  Field("iters", 3, "timed calls (device timer: calls in one trace)"),
  Field("cold_l2", True, "on a GPU, flush the L2 before each timed call (the flush is not timed; jaxkern.bench)"),
  Field("timeout_s", 600.0, "seconds per workload, compile included"),
  Field(
    "isolation",
    "process",
    "process: each device's worker is a child process, killed and replaced when a workload passes timeout_s "
    "(or crashes) | none: in this process, where timeout_s is only checked between a workload's steps "
    "(jaxkern.workers)",
  ),
  Field("progress", True, "a progress bar; False: one log line per workload"),
  Field(
    "coordinator_address",
    "",
    "several processes or hosts (jaxkern.shards): the coordinator's host:port; jax.distributed.initialize "
    "runs first and gives this process's index and the count",
  ),
  Field(
    "num_processes",
    0,
    "processes in all; 0: from the coordinator or the cluster environment (without a coordinator: the shard "
    "count, e.g. to resume one shard)",
  ),
  Field(
    "process_id",
    -1,
    "this process's index; -1: from the coordinator or the cluster environment (without a coordinator: which "
    "shard this process replays)",
  ),
  Field("devices", "all", "all: one worker per local device | first: device 0 only"),
)


def default_config() -> config_dict.ConfigDict:
  """Every replay config field, with its default."""
  c = config_dict.ConfigDict()
  for f in FIELDS:
    if f.default is not None:
      c[f.name] = f.default
    elif f.placeholder is not None:
      c[f.name] = config_dict.placeholder(f.placeholder)
    else:
      raise TypeError(f"replay config field {f.name}: a None default needs a placeholder type")
  return c


def fields_help(width: int = 100) -> str:
  """The fields as `--help` shows them: `NAME=DEFAULT` and the meaning, one
  field per line (wrapped to `width`)."""
  heads = [f"{f.name}={f.default!r}" for f in FIELDS]
  column = max(map(len, heads)) + 4
  lines = []
  for head, f in zip(heads, FIELDS):
    wrapped = textwrap.wrap(f.meaning, width - column) or [""]
    lines.append(f"  {head:<{column - 2}}{wrapped[0]}")
    lines += [" " * column + line for line in wrapped[1:]]
  return "\n".join(lines)
