"""Mixed FP8/FP4 MLA decode (SPEC 4.10, inferred):
`mixed_mla_decode_deepseek41_h64_d512_k8128_k4512`.

DeepSeek-V4.1-Flash decode attention: a sliding window of 128 recent tokens
in an FP8 paged cache (528-byte token records) plus 512 selected compressed
tokens in an FP4 paged cache (288-byte records); one softmax over both with a
per-head attention sink in the denominator only; natural-log lse without the
sink; lonely rows give 0 and +inf. Record formats: `jaxkern.quant`
(`quantize_mla_fp8_tokens`, `quantize_mla_fp4_tokens`). Kernel:
`pallas_kernels.mixed_mla` (split-K over the 640 key slots + logsumexp
combine).

Synthesis (SPEC 6) from the record's `scheduler_sequence_lengths`:
* window: sequence b of length L sees positions [max(0, L-128), L), stored at
  FP8 page `t // 256`, offset `t % 256` (the recorded N8 is exactly the number
  of 256-token pages the B windows span: N8 = 2 when a window straddles a
  page boundary, 4 for the B=3 batch);
* compressed: `L // 2` compressed tokens per sequence (*inferred*: the short
  records' N4 equals `ceil((L // 2) / 128)`, e.g. L = 2945 -> 12 pages,
  3850 -> 16, 4756 -> 19); each sequence selects `min(512, L // 2)` of them at
  random; sequences of one batch share their common prefix pages (the
  recorded B = 2, 3 batches are subagents of one session with a 34k-token
  common prefix, and their N4 is far below the sum of their page counts);
* the logical pages a batch references are mapped onto exactly N8 / N4
  physical pages in a random order; when more pages are referenced than
  exist (long sequences whose selections touch more pages than recorded, or
  a CPU-scaled run) pages are folded onto each other (`rank % N`), i.e. more
  sharing, when fewer, the rest exist unreferenced. Every page holds
  quantized N(0, 1) bf16 tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import dispatch, quant, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, Precondition, in_range
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.mixed_mla import KERNELS

# Compressed tokens per sequence token (inferred from the records, see above).
_COMPRESS_RATIO = 2
# Attention sinks: per-head logits of the size of typical scores.
_SINK_STD = 1.0
# cpu_axes: pages kept at CPU scale (the interpret-mode kernel copies whole
# caches per program; 64 FP4 pages are 2.4 MiB).
_CPU_MAX_PAGES_FP4 = 64
_CPU_MAX_PAGES_FP8 = 4


# ---------------------------------------------------------------------------
# Reference.


def _gather_rows(cache: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cache [N, P, 1, bytes], indices [K] -> (records [K, bytes], valid [K])."""
  flat = cache.reshape(cache.shape[0] * cache.shape[1], cache.shape[-1])
  if flat.shape[0] == 0:  # an empty cache: every slot invalid (no row to gather)
    return jnp.zeros((indices.shape[0], flat.shape[1]), flat.dtype), jnp.zeros(indices.shape, bool)
  valid = (indices >= 0) & (indices < flat.shape[0])
  return flat[jnp.where(valid, indices, 0)], valid


def mixed_mla_decode_reference(
  q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, sm_scale, attn_sink
) -> tuple[jax.Array, jax.Array]:
  """SPEC 4.10 in plain jnp, fp32 after dequantization, one sequence at a
  time (`lax.map`: a [640, 512] f32 key block per step).

  Returns `(out [B, H, D] bf16, lse [B, H] f32)`."""
  sink = attn_sink.astype(jnp.float32)

  def one_sequence(args):
    q_b, idx8, idx4 = args
    rec8, valid8 = _gather_rows(kv_fp8, idx8)
    rec4, valid4 = _gather_rows(kv_fp4, idx4)
    keys = jnp.concatenate(
      [quant.dequantize_mla_fp8_tokens(rec8), quant.dequantize_mla_fp4_tokens(rec4)], axis=0
    )  # [K8 + K4, D]
    valid = jnp.concatenate([valid8, valid4])
    keys = jnp.where(valid[:, None], keys, 0.0)
    logits = jnp.einsum("hd,kd->hk", q_b.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST) * sm_scale
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(logits - m_safe[:, None])  # 0 at invalid slots
    l = jnp.sum(p, axis=-1)
    seen = l > 0
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    o = jnp.einsum("hk,kd->hd", p, keys, precision=lax.Precision.HIGHEST)
    o = o / (l + jnp.exp(sink - m_safe))[:, None]
    return jnp.where(seen[:, None], o, 0.0).astype(q.dtype), lse

  return lax.map(one_sequence, (q, indices_fp8.astype(jnp.int32), indices_fp4.astype(jnp.int32)))


# ---------------------------------------------------------------------------
# Input synthesis.


def _sequence_lengths(axes: Mapping[str, int], record: dict | None, rng: np.random.Generator) -> list[int]:
  """Per-sequence token counts: the record's `scheduler_sequence_lengths`
  (the first B when a scaled run has fewer sequences), else random lengths
  whose compressed pages roughly match N4."""
  batch = int(axes["B"])
  recorded = list((record or {}).get("scheduler_sequence_lengths") or [])
  if len(recorded) >= batch:
    return [max(1, int(n)) for n in recorded[:batch]]
  pages4 = int(axes["N4"])
  hi = max(2, _COMPRESS_RATIO * int(axes["P4"]) * pages4)
  extra = [int(n) for n in rng.integers(1, hi + 1, size=batch - len(recorded))]
  return [max(1, int(n)) for n in recorded] + extra


def _physical_pages(logical: list[tuple], num_pages: int, rng: np.random.Generator) -> dict:
  """Maps distinct logical page keys to physical pages: a random order, and
  folded (`rank % num_pages`) when there are more keys than pages."""
  order = rng.permutation(num_pages)
  return {key: int(order[rank % num_pages]) for rank, key in enumerate(logical)}


def _window_indices(lengths: list[int], axes: Mapping[str, int], rng: np.random.Generator) -> np.ndarray:
  """[B, K8] flat FP8 rows of each sequence's last <= K8 tokens, -1 padded."""
  k8, p8, n8 = int(axes["K8"]), int(axes["P8"]), int(axes["N8"])
  positions = [np.arange(max(0, n - k8), n) for n in lengths]
  logical = list(dict.fromkeys((b, int(t) // p8) for b, pos in enumerate(positions) for t in pos))
  page = _physical_pages(logical, n8, rng)
  out = np.full((len(lengths), k8), -1, np.int64)
  for b, pos in enumerate(positions):
    rows = [page[(b, int(t) // p8)] * p8 + int(t) % p8 for t in pos]
    out[b, : len(rows)] = rows
  return out


def _compressed_indices(lengths: list[int], axes: Mapping[str, int], rng: np.random.Generator) -> np.ndarray:
  """[B, K4] flat FP4 rows of each sequence's selected compressed tokens
  (ascending), -1 padded. The pages of the batch's common prefix are shared."""
  k4, p4, n4 = int(axes["K4"]), int(axes["P4"]), int(axes["N4"])
  compressed = [n // _COMPRESS_RATIO for n in lengths]
  # Whole pages of the shortest sequence, but its last, are the shared prefix.
  shared_pages = max(0, -(-min(compressed) // p4) - 1) if len(lengths) > 1 else 0
  selections = [
    np.sort(rng.choice(n, size=min(k4, n), replace=False)) if n else np.zeros(0, np.int64) for n in compressed
  ]

  def logical_page(b, t):
    lp = int(t) // p4
    return ("shared", lp) if lp < shared_pages else (b, lp)

  logical = list(dict.fromkeys(logical_page(b, t) for b, sel in enumerate(selections) for t in sel))
  page = _physical_pages(logical, n4, rng)
  out = np.full((len(lengths), k4), -1, np.int64)
  for b, sel in enumerate(selections):
    rows = [page[logical_page(b, t)] * p4 + int(t) % p4 for t in sel]
    out[b, : len(rows)] = rows
  return out


def _synthesize(
  key: jax.Array, *, batch: int, heads: int, head_dim: int, pages8: int, page8: int, pages4: int, page4: int
):
  key_q, key_k8, key_k4, key_sink = jax.random.split(key, 4)
  q = jax.random.normal(key_q, (batch, heads, head_dim), jnp.bfloat16)
  tokens8 = jax.random.normal(key_k8, (pages8, page8, 1, head_dim), jnp.bfloat16)
  tokens4 = jax.random.normal(key_k4, (pages4, page4, 1, head_dim), jnp.bfloat16)
  sink = _SINK_STD * jax.random.normal(key_sink, (heads,), jnp.float32)
  return q, quant.quantize_mla_fp8_tokens(tokens8), quant.quantize_mla_fp4_tokens(tokens4), sink


_synthesize_jit = jax.jit(
  _synthesize, static_argnames=("batch", "heads", "head_dim", "pages8", "page8", "pages4", "page4")
)


def make_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """Deterministic inputs for `axes` (see the module docstring); valid for
  any B >= 1, N8 >= 1, N4 >= 1, with or without a record."""
  batch, heads, head_dim = int(axes["B"]), int(axes["H"]), int(axes["D"])
  seed = int(jax.random.randint(jax.random.fold_in(key, 1), (), 0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  lengths = _sequence_lengths(axes, record, rng)
  q, kv_fp8, kv_fp4, sink = _synthesize_jit(
    key,
    batch=batch,
    heads=heads,
    head_dim=head_dim,
    pages8=int(axes["N8"]),
    page8=int(axes["P8"]),
    pages4=int(axes["N4"]),
    page4=int(axes["P4"]),
  )
  return {
    "q": q,
    "kv_fp8": kv_fp8,
    "indices_fp8": jnp.asarray(_window_indices(lengths, axes, rng), jnp.int32),
    "kv_fp4": kv_fp4,
    "indices_fp4": jnp.asarray(_compressed_indices(lengths, axes, rng), jnp.int32),
    "sm_scale": jnp.asarray(head_dim**-0.5, jnp.float32),
    "attn_sink": sink,
  }


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """B, H, D and the 640 key slots are kept (the work per sequence is fixed;
  its time: docs/perf/cpu_budgets.md); only the page counts
  are capped (N4 <= 64, N8 <= 4), which folds the selected pages onto each
  other (more sharing) but keeps every index pattern: window length,
  selection count, -1 padding."""
  out = dict(axes)
  out["N4"] = min(int(axes["N4"]), _CPU_MAX_PAGES_FP4)
  out["N8"] = min(int(axes["N8"]), _CPU_MAX_PAGES_FP8)
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def mixed_mla_decode_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Mixed FP8/FP4 MLA decode. With the run's index tables: FLOPs 4 H D per
  valid slot (a flat row in [0, N8 P8) resp. [0, N4 P4)), summed over batch
  rows; of the paged caches only the distinct tokens gathered, as stored
  (FP8: 512 e4m3 bytes + 4 f32 scales = 528; FP4: 256 packed bytes + 32
  UE8M0 scales = 288 per token); the gather floor is every valid slot's
  token once per batch row. Without inputs each row has min(K8, N8 P8) +
  min(K4, N4 P4) valid slots and min(B K8, N8 P8) + min(B K4, N4 P4)
  distinct tokens (bounds). q, both index tables, sink and the scalar read,
  out and lse written once. The dequantized tokens meet the queries in bf16
  dots: the bf16 peak."""
  slots, tokens, gather, source = 0, 0, 0, "axes"
  for cache, table, keys, pages, page in (
    ("kv_fp8", "indices_fp8", "K8", "N8", "P8"),
    ("kv_fp4", "indices_fp4", "K4", "N4", "P4"),
  ):
    n = axes[pages] * axes[page]
    token = roofline.tensor_bytes(definition, cache, axes) // max(n, 1)
    idx = None if inputs is None else inputs.get(table)
    if idx is None:
      valid_slots, distinct = axes["B"] * min(axes[keys], n), min(axes["B"] * axes[keys], n)
    else:
      idx = roofline.host(idx)
      valid = idx[(idx >= 0) & (idx < n)]
      valid_slots, distinct, source = valid.size, np.unique(valid).size, "inputs"
    slots, tokens, gather = slots + valid_slots, tokens + distinct * token, gather + valid_slots * token
  flops = 4 * axes["H"] * axes["D"] * slots
  nbytes = roofline.io_bytes(definition, axes, skip=("kv_fp8", "kv_fp4")) + tokens
  return roofline.Work(flops, nbytes, "bf16", gather_bytes=gather, counted_from=source)


# ---------------------------------------------------------------------------
# Kernel registration.

# How the op splits across devices (`jaxkern.spmd`): sequences (with their
# indices) and heads (with their sinks); indices address the whole caches.
_CACHE = "indices address rows of the whole cache"
SPLIT = Split(
  inputs={
    "q": "b h d",
    "kv_fp8": "n8 p8 o8 r8",
    "indices_fp8": "b k8",
    "kv_fp4": "n4 p4 o4 r4",
    "indices_fp4": "b k4",
    "sm_scale": "",
    "attn_sink": "h",
  },
  outputs=("b h d", "b h"),
  independent="b h",
  reasons={
    "n8": _CACHE,
    "p8": _CACHE,
    "n4": _CACHE,
    "p4": _CACHE,
    "d": CONTRACTION,
    **dict.fromkeys(("k8", "k4"), "the softmax runs over all selected keys"),
  },
)


def preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode: every index is -1 or a token row of its cache."""

  def rule(name: str, cache: str) -> Precondition:
    idx, (pages, page) = inputs[name], inputs[cache].shape[:2]
    return Precondition(
      name,
      (idx == -1) | in_range(idx, 0, pages * page),
      f"-1 (empty slot) or [0, N*P) with N*P = {pages}*{page} ({cache} pages x tokens per page)",
    )

  return [rule("indices_fp8", "kv_fp8"), rule("indices_fp4", "kv_fp4")]


IMPL = OpImpl(
  reference=mixed_mla_decode_reference,
  kernels=KERNELS,
  make_inputs=make_inputs,
  cpu_axes=cpu_axes,
  cost=mixed_mla_decode_cost,
  split=SPLIT,
  preconditions=preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, attn_sink, *, sm_scale=None, **_) -> None:
  """The contract of `mixed_mla_decode` (`jaxkern.contract`): q [B, H, D]
  with D a multiple of 128, one-head caches of D's record sizes, index
  tables [B, K], attn_sink [H]."""
  c = Checks("mixed_mla_decode")
  c.rank("q", q, "[B, H, D]", 3)
  batch, heads, head_dim = q.shape
  if head_dim % quant.MLA_FP8_GROUP:
    c.fail("q", f"[B, H, D] with D a multiple of {quant.MLA_FP8_GROUP}", f"shape {tuple(q.shape)}")
  fp8_bytes = head_dim + 4 * (head_dim // quant.MLA_FP8_GROUP)
  fp4_bytes = head_dim // 2 + head_dim // quant.MLA_FP4_GROUP
  why = f"one latent KV head, D = {head_dim} from q"
  c.shape("kv_fp8", kv_fp8, (None, None, 1, fp8_bytes), "[N8, P8, 1, D + D/32]", why)
  c.shape("indices_fp8", indices_fp8, (batch, None), "[B, K8]", "B from q")
  c.shape("kv_fp4", kv_fp4, (None, None, 1, fp4_bytes), "[N4, P4, 1, D/2 + D/16]", why)
  c.shape("indices_fp4", indices_fp4, (batch, None), "[B, K4]", "B from q")
  c.shape("attn_sink", attn_sink, (heads,), "[H]", "H from q")
  c.floating("q", q)
  c.dtype("kv_fp8", kv_fp8, [jnp.uint8])
  c.integer("indices_fp8", indices_fp8)
  c.dtype("kv_fp4", kv_fp4, [jnp.uint8])
  c.integer("indices_fp4", indices_fp4)
  c.floating("attn_sink", attn_sink)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate, was_positional=("sm_scale",))
def mixed_mla_decode(
  q: jax.Array,
  kv_fp8: jax.Array,
  indices_fp8: jax.Array,
  kv_fp4: jax.Array,
  indices_fp4: jax.Array,
  attn_sink: jax.Array,
  *,
  sm_scale: float | jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V4 MLA decode over an FP8 window cache and an FP4 compressed cache.

  q [B, H, D] bf16; kv_fp8 [N8, P8, 1, D + D/32] uint8 token records (see
  `jaxkern.quant.quantize_mla_fp8_tokens`) read at flat rows indices_fp8
  [B, K8] int32; kv_fp4 [N4, P4, 1, D/2 + D/16] uint8 (`quantize_mla_fp4_tokens`)
  read at indices_fp4 [B, K4] int32; attn_sink [H] f32 joins the softmax
  denominator only; sm_scale defaults to D**-0.5. Returns (out [B, H, D]
  bf16, lse [B, H] f32 natural log without the sink).

  Contract:
  * B >= 0; D a multiple of 128; one latent KV head; N8, N4 >= 1.
  * indices_fp8 valid: -1 (empty slot) or `[0, N8*P8)`; indices_fp4: -1 or
    `[0, N4*P4)` (flat rows `page * P + offset`). Any other value is an empty
    slot like -1: it contributes nothing and its record is never read into
    the output (`checks=True` reports it instead). A row with no valid
    index gives out 0 and lse +inf.
  * Records are not validated: a selected record whose scales decode to
    Inf or NaN reaches its row.

  Backends: `xla`, `triton`, `mosaic_gpu` (q bf16 with H a multiple of 64
  and D 512; `backend="pallas"` falls back to Triton for other inputs)."""
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  inputs = dict(
    q=q,
    kv_fp8=kv_fp8,
    indices_fp8=indices_fp8,
    kv_fp4=kv_fp4,
    indices_fp4=indices_fp4,
    sm_scale=jnp.asarray(sm_scale, jnp.float32),
    attn_sink=attn_sink,
  )
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
