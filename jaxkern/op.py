"""The contract between a definition and its implementations.

A kernel family module in `jaxkern.families` exports `IMPLS`, a dict from
definition name to `OpImpl`. The registry pairs each `OpImpl` with the
definition's JSON to form the user-facing `Op`.

Conventions every family follows:
* `reference(**inputs) -> dict[str, Array]`: plain `jax.numpy`, bounded memory.
* `make_inputs(axes, key, record) -> dict[str, Array]`: `axes` holds every axis
  (var and const); `record` is the raw workload dict or None. The record's own
  `axes` may be larger than `axes` (a scaled run): provenance such as sequence
  lengths is then rescaled to fit. Scalars are 0-d arrays.
* `kernel(**inputs, interpret: bool | None, config) -> dict[str, Array]`: the
  Pallas implementation; `config=None` means the heuristic's choice.
* `choose_config(shapes) -> config` and `candidate_configs(shapes) -> list`:
  `shapes` maps input name to `jax.ShapeDtypeStruct`; candidates are what a
  sweep explores and what the lowering tests check.
* `cpu_axes(axes) -> axes`: a shrunk copy of `axes` that keeps the definition's
  structure but fits an interpret-mode CPU budget (about a second of work).
* `output_policies`: output name -> a comparison policy other than the dtype
  default (today only "gdn_prefill_state", SPEC section 5).
* `topk_scores`: for outputs that are top-k selections, a function of the inputs
  returning the scores the selection ranks, shaped like the output's rows by
  candidate ids (`[rows, n_candidates]`); `paired_outputs` names the outputs
  permuted together with a selection (compared on the ids both selected).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax

Inputs = Mapping[str, jax.Array]
Outputs = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class OpImpl:
  reference: Callable[..., Outputs]
  make_inputs: Callable[[dict[str, int], jax.Array, dict | None], dict[str, jax.Array]]
  kernel: Callable[..., Outputs]
  choose_config: Callable[[Mapping[str, jax.ShapeDtypeStruct]], Any]
  candidate_configs: Callable[[Mapping[str, jax.ShapeDtypeStruct]], list[Any]]
  cpu_axes: Callable[[dict[str, int]], dict[str, int]]
  topk_scores: Mapping[str, Callable[[Inputs], jax.Array]] = dataclasses.field(default_factory=dict)
  paired_outputs: Mapping[str, str] = dataclasses.field(default_factory=dict)
  output_policies: Mapping[str, str] = dataclasses.field(default_factory=dict)
