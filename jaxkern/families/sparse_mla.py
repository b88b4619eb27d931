"""DeepSeek sparse MLA prefill (SPEC 4.9):
`sparse_mla_prefill_h64_d512_k{128,640}` (FlashMLA `flash_mla_sparse_fwd`,
DeepSeek-V4 shape: one latent KV head, D = 512 used as both K and V).

Per query row m and head h, over the valid slots of `indices[m, 0, :]`
(`0 <= idx < Nkv`; -1 and `>= Nkv` are invalid):
  P = q[m, h] . kv[idx] * sm_scale;  lse = logsumexp(P) (natural log, no sink)
  out = sum exp(P) kv[idx] / (sum exp(P) + exp(attn_sink[h]))
A lonely row (no valid slot) gives out 0 and lse +inf.
Kernel: `pallas_kernels.sparse_mla`.

Input synthesis (SPEC 4.9 / 6; the layout is our reading of the records,
which it reproduces exactly: Nkv = sum(new_i + min(127, cached_i)) +
sum(seq_len_i // ratio)):
* `scheduler_sequence_lengths` are the sequences' total lengths (cached +
  new); the M new query tokens are split evenly over them (first sequences
  get the remainder), so `cached_i = seq_len_i - new_i`.
* the workspace is `[window rows | compressed rows | spare rows]`: window rows
  per sequence, in order, are its last `min(127, cached_i)` cached tokens then
  its `new_i` new tokens; compressed rows per sequence, in order, are
  `seq_len_i // ratio` rows (`compression_ratio`; 0 = none), row j summarizing
  tokens `[j*ratio, (j+1)*ratio)`; spare rows (only where the axes cannot hold
  the structure exactly) are never indexed.
* query token at position p of its sequence: slots `[0, 128)` hold its last
  `min(128, p+1)` window tokens in ascending order, then -1; for TOPK > 128,
  slots `[128, TOPK)` hold the compressed rows it may see (`(j+1)*ratio <=
  p+1`), all of them when at most TOPK-128, else a stratified random
  selection of TOPK-128 (one per equal stratum: distinct, ascending, spread
  over the whole history as DSA's top-k tends to be), then -1.
* no record: one sequence, ratio 0 for TOPK <= 128 and 2 otherwise, cached
  tokens chosen to fill Nkv. A record whose axes were scaled down keeps its
  ratio and the relative sequence lengths; the total length is refitted to
  the scaled Nkv. If compressed rows cannot fit at all (Nkv too close to M)
  the layout falls back to window only.
* q, kv ~ N(0, 1) bf16 (post-norm latents: unit-variance logits at
  sm_scale = 512**-0.5); attn_sink ~ U(-2, 4): exp(sink) from 0.1 to 55, a
  visible share of denominators of 128-640 terms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, Precondition, in_range
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.sparse_mla import KERNELS

# Recent tokens a query sees (itself included), and cached window rows kept
# per sequence (the window of the first new token).
WINDOW = 128
CACHED_WINDOW = WINDOW - 1
# Compression ratio synthesized when there is no record and TOPK > WINDOW.
DEFAULT_RATIO = 2
_SINK_RANGE = (-2.0, 4.0)
# Query rows gathered at once by the reference: [chunk, TOPK, D] fp32 is
# 42 MiB at TOPK = 640.
_REFERENCE_ROW_CHUNK = 32
# cpu_axes: query rows kept; workspace extras (rows beyond M) up to this are
# kept as recorded (the cached window: 127 per sequence).
_CPU_ROWS = 16
_CPU_KEEP_EXTRA = 256


# ---------------------------------------------------------------------------
# Reference.


def sparse_mla_prefill_reference(q, kv, indices, sm_scale, attn_sink):
  """Plain jnp, fp32 at HIGHEST precision, gathering the selected rows per
  chunk of `_REFERENCE_ROW_CHUNK` query rows (never an [M, Nkv] score
  matrix). Returns `(out [M, H, D] q.dtype, lse [M, H] f32)`. Invalid slots
  are selected away (scores -inf, gathered rows 0 by `where`): what lies
  behind them never reaches the output."""
  m, num_heads, head_dim = q.shape
  num_kv = kv.shape[0]
  topk = indices.shape[-1]
  chunk = min(_REFERENCE_ROW_CHUNK, max(m, 1))
  num_chunks = -(-m // chunk)
  pad = num_chunks * chunk - m
  idx = jnp.pad(indices.reshape(m, topk).astype(jnp.int32), ((0, pad), (0, 0)), constant_values=-1)
  q_pad = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
  kv2 = kv.reshape(num_kv, head_dim)
  sink = attn_sink.astype(jnp.float32)
  scale = jnp.asarray(sm_scale, jnp.float32)

  def one_chunk(args):
    q_c, idx_c = args  # [c, H, D], [c, T]
    valid = (idx_c >= 0) & (idx_c < num_kv)
    rows = jnp.take(kv2, jnp.where(valid, idx_c, 0), axis=0).astype(jnp.float32)  # [c, T, D]
    rows = jnp.where(valid[..., None], rows, 0.0)
    s = jnp.einsum("chd,ctd->cht", q_c.astype(jnp.float32), rows, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    mx = jnp.max(s, axis=-1)  # [c, H]
    seen = mx > -jnp.inf
    mx = jnp.where(seen, mx, 0.0)
    p = jnp.exp(s - mx[..., None])  # 0 where invalid
    l = jnp.sum(p, axis=-1)
    lse = jnp.where(seen, mx + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    denom = l + jnp.exp(sink[None, :] - mx)
    o = jnp.einsum("cht,ctd->chd", p, rows, precision=lax.Precision.HIGHEST)
    o = jnp.where(seen[..., None], o / denom[..., None], 0.0)
    return o.astype(q.dtype), lse

  out, lse = lax.map(
    one_chunk, (q_pad.reshape(num_chunks, chunk, num_heads, head_dim), idx.reshape(num_chunks, chunk, topk))
  )
  return (out.reshape(-1, num_heads, head_dim)[:m], lse.reshape(-1, num_heads)[:m])


# ---------------------------------------------------------------------------
# Input synthesis.


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
  """Where each sequence's rows live in the workspace (see module doc)."""

  new: tuple[int, ...]  # new (query) tokens per sequence
  cached: tuple[int, ...]  # cached tokens per sequence
  ratio: int  # compression ratio; 0 = window only
  spare: int  # never-indexed rows at the end

  @property
  def window_cached(self) -> tuple[int, ...]:
    return tuple(min(CACHED_WINDOW, c) for c in self.cached)

  @property
  def seq_lens(self) -> tuple[int, ...]:
    return tuple(n + c for n, c in zip(self.new, self.cached))

  @property
  def compressed(self) -> tuple[int, ...]:
    return tuple(s // self.ratio if self.ratio else 0 for s in self.seq_lens)

  @property
  def window_rows(self) -> int:
    return sum(self.new) + sum(self.window_cached)

  @property
  def num_rows(self) -> int:
    return self.window_rows + sum(self.compressed) + self.spare


def _split_evenly(total: int, parts: int) -> list[int]:
  return [total // parts + (i < total % parts) for i in range(parts)]


def _rows(new: Sequence[int], cached: Sequence[int], ratio: int) -> int:
  return WorkspaceLayout(tuple(new), tuple(cached), ratio, 0).num_rows


def workspace_layout(m: int, nkv: int, topk: int, record: Mapping | None = None) -> WorkspaceLayout:
  """The workspace structure for `M = m`, `Nkv = nkv` (module doc).

  With a record whose axes are these axes the recorded structure is exact
  (spare = 0). Otherwise the sequence lengths keep the record's proportions
  (equal without a record) and their total is the smallest that fills
  `nkv` rows (window rows saturate at 127 cached per sequence; compressed
  rows grow without bound); what cannot be filled exactly is spare.
  """
  if nkv < m:
    raise ValueError(f"Nkv={nkv} < M={m}")
  record = record or {}
  recorded = [int(s) for s in record.get("scheduler_sequence_lengths") or []]
  ratio = record.get("compression_ratio")
  ratio = int(ratio) if ratio is not None else (DEFAULT_RATIO if topk > WINDOW else 0)
  num_seqs = max(1, min(len(recorded) or 1, m))
  new = _split_evenly(m, num_seqs)

  rec_axes = record.get("axes") or {}
  if recorded and len(recorded) == num_seqs and rec_axes.get("M") == m and all(s >= n for s, n in zip(recorded, new)):
    cached = [s - n for s, n in zip(recorded, new)]
    if _rows(new, cached, ratio) == nkv:
      return WorkspaceLayout(tuple(new), tuple(cached), ratio, 0)

  if ratio and _rows(new, [0] * num_seqs, ratio) > nkv:
    ratio = 0  # not even the new tokens' compressed rows fit
  shares = recorded[:num_seqs] if len(recorded) >= num_seqs else [1] * num_seqs
  total_share = sum(shares)

  def cached_for(total: int) -> list[int]:
    return [max(0, round(total * s / total_share) - n) for s, n in zip(shares, new)]

  def rows_for(total: int) -> int:
    return _rows(new, cached_for(total), ratio)

  target = nkv if ratio else min(nkv, m + CACHED_WINDOW * num_seqs)
  lo, hi = m, max(m, 1)
  while rows_for(hi) < target:
    lo, hi = hi, hi * 2
  while lo < hi:  # smallest total with rows >= target
    mid = (lo + hi) // 2
    if rows_for(mid) >= target:
      hi = mid
    else:
      lo = mid + 1
  total = lo if rows_for(lo) <= nkv else lo - 1
  cached = cached_for(total)
  return WorkspaceLayout(tuple(new), tuple(cached), ratio, nkv - _rows(new, cached, ratio))


def layout_indices(layout: WorkspaceLayout, topk: int, rng: np.random.Generator) -> np.ndarray:
  """`[M, 1, TOPK]` int32 indices for `layout` (module doc)."""
  window_slots = min(WINDOW, topk)
  comp_slots = topk - window_slots if layout.ratio else 0
  out = np.full((sum(layout.new), topk), -1, np.int64)
  window_base = np.cumsum([0, *[n + w for n, w in zip(layout.new, layout.window_cached)]])
  comp_base = layout.window_rows + np.cumsum([0, *layout.compressed])
  row = 0
  for i, (new, cached) in enumerate(zip(layout.new, layout.cached)):
    pos = cached + np.arange(new)  # positions of the queries
    first_window_token = cached - layout.window_cached[i]
    w = np.minimum(window_slots, pos + 1)  # window tokens seen
    s = np.arange(window_slots)
    tok = pos[:, None] - w[:, None] + 1 + s[None, :]  # ascending, last = pos
    out[row : row + new, :window_slots] = np.where(
      s[None, :] < w[:, None], window_base[i] + tok - first_window_token, -1
    )
    if comp_slots:
      visible = (pos + 1) // layout.ratio  # compressed rows seen
      j = np.arange(comp_slots)
      # Stratified choice when more are visible than fit: stratum
      # [j*V//K, (j+1)*V//K) of each slot j holds at least one row.
      lo = (j[None, :] * visible[:, None]) // comp_slots
      hi = ((j[None, :] + 1) * visible[:, None]) // comp_slots
      pick = lo + np.floor(rng.random(lo.shape) * np.maximum(hi - lo, 1)).astype(np.int64)
      chosen = np.where(visible[:, None] > comp_slots, pick, j[None, :])
      out[row : row + new, window_slots:] = np.where(
        j[None, :] < np.minimum(visible, comp_slots)[:, None], comp_base[i] + chosen, -1
      )
    row += new
  return out.astype(np.int32)[:, None, :]


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """Realistic sparse-prefill inputs (module doc); deterministic in `key`."""
  m, nkv, h, hkv, d, topk = (int(axes[n]) for n in ("M", "Nkv", "H", "HKV", "D", "TOPK"))
  layout = workspace_layout(m, nkv, topk, record)
  key_q, key_kv, key_sink, key_idx = jax.random.split(key, 4)
  seed = int(jax.random.randint(key_idx, (), 0, np.iinfo(np.int32).max))
  indices = layout_indices(layout, topk, np.random.default_rng(seed))
  return {
    "q": jax.random.normal(key_q, (m, h, d), jnp.bfloat16),
    "kv": jax.random.normal(key_kv, (nkv, hkv, d), jnp.bfloat16),
    "indices": jnp.asarray(indices),
    "sm_scale": jnp.asarray(d**-0.5, jnp.float32),
    "attn_sink": jax.random.uniform(key_sink, (h,), jnp.float32, *_SINK_RANGE),
  }


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """M -> 16 query rows; the workspace extras (Nkv - M) kept when at most 256
  (the cached window rows), else scaled by the same factor as M (so a record
  with ~1M compressed rows keeps thousands: selection still picks 512 of
  many). H, D, TOPK kept (the time of 16 rows x 640 slots:
  docs/perf/cpu_budgets.md)."""
  out = dict(axes)
  m, nkv = int(axes["M"]), int(axes["Nkv"])
  new_m = min(m, _CPU_ROWS)
  extra = nkv - m
  if extra > _CPU_KEEP_EXTRA:
    extra = math.ceil(extra * new_m / m)
  out["M"], out["Nkv"] = new_m, new_m + extra
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def sparse_mla_prefill_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Sparse MLA over gathered latent rows (D used as both K and V). With the
  run's `indices`: FLOPs 4 H D per valid slot (an index in [0, Nkv); -1 and
  out-of-range slots are never scored), summed over query rows; of the
  workspace kv only the distinct rows some query gathers; the gather floor
  (`gather_bytes`) is every valid slot's row once per query row (M TOPK rows
  of D bf16 = 1 KiB each when every slot is valid). Without inputs every
  row has min(TOPK, Nkv) valid slots and min(M TOPK, Nkv) distinct rows are
  gathered (bounds). q, indices, sink and the scalar read, out and lse
  written once."""
  row = roofline.tensor_bytes(definition, "kv", axes) // max(axes["Nkv"], 1)
  indices = None if inputs is None else inputs.get("indices")
  if indices is None:
    slots, rows, source = axes["M"] * min(axes["TOPK"], axes["Nkv"]), min(axes["M"] * axes["TOPK"], axes["Nkv"]), "axes"
  else:
    idx = roofline.host(indices)
    valid = idx[(idx >= 0) & (idx < axes["Nkv"])]
    slots, rows, source = valid.size, np.unique(valid).size, "inputs"
  nbytes = roofline.io_bytes(definition, axes, skip=("kv",)) + rows * row
  return roofline.Work(4 * axes["H"] * axes["D"] * slots, nbytes, "bf16", gather_bytes=slots * row, counted_from=source)


# ---------------------------------------------------------------------------
# Registration.


# How the op splits across devices (`jaxkern.spmd`): query rows (with their
# indices) and heads (with their sinks); indices address the whole workspace.
SPLIT = Split(
  inputs={"q": "m h d", "kv": "n o d", "indices": "m o k", "sm_scale": "", "attn_sink": "h"},
  outputs=("m h d", "m h"),
  independent="m h",
  reasons={
    "n": "indices address rows of the whole latent workspace",
    "k": "the softmax runs over all selected keys",
    "d": CONTRACTION,
  },
)


def preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode: every slot is -1 or a workspace row."""
  idx, rows = inputs["indices"], inputs["kv"].shape[0]
  return [
    Precondition(
      "indices", (idx == -1) | in_range(idx, 0, rows), f"-1 (empty slot) or [0, Nkv) with Nkv = {rows} (kv.shape[0])"
    )
  ]


IMPL = OpImpl(
  reference=sparse_mla_prefill_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=sparse_mla_prefill_cost,
  split=SPLIT,
  preconditions=preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(q, kv, indices, attn_sink, *, sm_scale=None, **_) -> None:
  """The contract of `sparse_mla_prefill` (`jaxkern.contract`): q [M, H, D],
  kv [Nkv, D] or [Nkv, 1, D] in q's float dtype, integer indices [M, TOPK]
  or [M, 1, TOPK], attn_sink [H]."""
  c = Checks("sparse_mla_prefill")
  c.rank("q", q, "[M, H, D]", 3)
  rows, heads, head_dim = q.shape
  c.array("kv", kv)
  kv_layout = (None, head_dim) if kv.ndim == 2 else (None, 1, head_dim)
  c.shape("kv", kv, kv_layout, "[Nkv, D] or [Nkv, 1, D]", "one latent head, D from q")
  c.array("indices", indices)
  index_layout = (rows, None) if indices.ndim == 2 else (rows, 1, None)
  c.shape("indices", indices, index_layout, "[M, TOPK] or [M, 1, TOPK]", "M from q")
  c.shape("attn_sink", attn_sink, (heads,), "[H]", "H from q")
  c.floating("q", q)
  c.same_dtype("kv", kv, "q", q)
  c.integer("indices", indices)
  c.floating("attn_sink", attn_sink)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate)
def sparse_mla_prefill(
  q: jax.Array,
  kv: jax.Array,
  indices: jax.Array,
  attn_sink: jax.Array,
  *,
  sm_scale: float | jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek sparse MLA prefill (FlashMLA sparse semantics): q [M, H, D],
  latent workspace kv [Nkv, D] or [Nkv, 1, D] (key and value), indices
  [M, TOPK] or [M, 1, TOPK] int32, per-head sink logits attn_sink [H] f32
  (denominator only); sm_scale defaults to D**-0.5. Returns (out [M, H, D]
  in q's dtype, lse [M, H] f32, natural log, sink excluded).

  Contract:
  * M >= 0 query rows, Nkv >= 1, q and kv bf16.
  * indices valid: -1 (empty slot) or [0, Nkv). Any other value (< -1 or
    >= Nkv) is an invalid slot like -1: it contributes nothing, and the
    row behind it is never read into the output (`checks=True` reports
    such a value instead). A row repeated in several slots counts once
    per slot. A row with no valid slot gives out 0 and lse +inf.
  * Non-finite values in rows a slot selects reach that query row.

  Backends: `xla`, `triton`, `mosaic_gpu` (bf16 with H a multiple of 64 and
  D 256 or 512; `backend="pallas"` falls back to Triton for other inputs)."""
  m, _, d = q.shape
  inputs = dict(
    q=q,
    kv=kv.reshape(kv.shape[0], 1, d),
    indices=indices.reshape(m, 1, indices.shape[-1]),
    sm_scale=jnp.asarray(d**-0.5 if sm_scale is None else sm_scale, jnp.float32),
    attn_sink=attn_sink,
  )
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
