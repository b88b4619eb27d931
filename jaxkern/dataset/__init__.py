"""Typed definitions and workload records, their validation, and the importer.

Layout of a dataset directory (default: the repository's `datasets/`):
  definitions/<name>.json   one definition each (modelled on FlashInfer-Bench's;
                            `jaxkern.fib` exports ones its client loads)
  workloads/<name>.jsonl    the recorded workloads of that definition, one JSON
                            object per line, every recorded field preserved

Modules: `records` (the types and `DatasetError`), `constraints` (the
definitions' constraint language), `loading` (definitions, workloads, record
validation), `importer` (convert, stats and the command line,
`python -m jaxkern.dataset convert|validate|stats`). The public names are
re-exported here.
"""

from jaxkern.dataset.constraints import holds as constraint_holds
from jaxkern.dataset.constraints import parse_constraint
from jaxkern.dataset.importer import convert, main, record_from_line, stats_rows
from jaxkern.dataset.loading import (
  ErrorSink,
  close_matches,
  default_dataset_dir,
  iter_jsonl,
  load_definitions,
  load_workloads,
  parse_definition,
  validate_dataset,
  validate_record,
  workloads_path,
)
from jaxkern.dataset.records import (
  CORE_FIELDS,
  DTYPES,
  NP_DTYPES,
  AxisSpec,
  DatasetError,
  Definition,
  TensorSpec,
  Workload,
)

__all__ = [
  "AxisSpec",
  "CORE_FIELDS",
  "DTYPES",
  "DatasetError",
  "Definition",
  "ErrorSink",
  "NP_DTYPES",
  "TensorSpec",
  "Workload",
  "close_matches",
  "constraint_holds",
  "convert",
  "default_dataset_dir",
  "iter_jsonl",
  "load_definitions",
  "load_workloads",
  "main",
  "parse_constraint",
  "parse_definition",
  "record_from_line",
  "stats_rows",
  "validate_dataset",
  "validate_record",
  "workloads_path",
]
