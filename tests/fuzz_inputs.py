"""Inputs of the differential fuzz test (`test_fuzz.py`) and of the checked
mode test (`test_checked_mode.py`), not a test file: for every public op a
`Target` (how to call it from named inputs, whose kernel it is) and its
`Case`s, each a seeded builder of small inputs.

Case kinds:
* "valid": inside the op's contract (random data, edge values, tiny and
  zero sizes, unsorted or duplicate indices where the contract allows them);
  checked mode passes.
* "invalid": an index or length input outside its valid range (`bad` names
  it); the op still answers as its reference defines; checked mode names it.
* "masked": `build` returns (poisoned, clean): NaN/Inf placed only where the
  contract hides it (masked keys, invalid slots, padding rows, pages nobody
  reads); both paths must give the clean answer.

Shapes stay few per op (the main one, plus tiny ones) so that interpret
mode compiles each op a handful of times.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkern import ops, quant
from jaxkern.families import (
  dense_gemm,
  flash_attention,
  gdn_decode,
  gdn_prefill,
  grouped_gemm,
  mixed_mla,
  moe_router,
  neighborhood_attention,
  qsa_index,
  qsa_sparse_gqa,
  sparse_mla,
)
from jaxkern.family import OpImpl

NAN, INF = float("nan"), float("inf")
Inputs = dict[str, Any]

# The quantizers jitted: one compile per shape instead of one per op.
quantize_fp8 = jax.jit(quant.quantize_fp8_e4m3, static_argnums=1)
quantize_e2m1 = jax.jit(quant.quantize_e2m1, static_argnums=1)
quantize_fp8_tokens = jax.jit(quant.quantize_mla_fp8_tokens)
quantize_fp4_tokens = jax.jit(quant.quantize_mla_fp4_tokens)


@dataclasses.dataclass(frozen=True)
class Case:
  label: str
  build: Callable[[np.random.Generator], Any]
  kind: str = "valid"  # "valid", "invalid" or "masked"
  bad: str = ""  # the out-of-range argument ("invalid", or "masked" outside the contract)
  # For an invalid case: the inputs inside the contract that the op's
  # contract says answer the same (e.g. out-of-range ids made -1).
  same_as: Callable[[Inputs], Inputs] | None = None


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # the op in `jaxkern.ops`
  owner: str  # the helper whose kernel it is
  impl: OpImpl  # its policies and definition outputs
  call: Callable[..., Any]  # call(inputs, backend=, checks=) -> the op's outputs
  cases: tuple[Case, ...]


def draws(target: Target, case: Case, seeds: int):
  """(inputs, clean or None) for `seeds` seeded draws of a case."""
  for seed in range(seeds):
    rng = np.random.default_rng([zlib.crc32(f"{target.name}/{case.label}".encode()), seed])
    built = case.build(rng)
    yield built if case.kind == "masked" else (built, None)


def bf16(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale, jnp.bfloat16)


def f32(x):
  return jnp.asarray(x, jnp.float32)


def i32(x):
  return jnp.asarray(x, jnp.int32)


def put(x: Inputs, **changes) -> Inputs:
  return {**x, **changes}


def poison_rows(x, rows, value=NAN, axis=0):
  """x with the given rows (along `axis`) set to `value`."""
  y = np.array(x, np.float32)
  np.moveaxis(y, axis, 0)[np.asarray(rows)] = value
  return jnp.asarray(y, x.dtype)


# ---------------------------------------------------------------------------
# Dense GEMM, router, grouped GEMM.


def gemm(rng, m=24, n=40, k=48):
  return {"a": bf16(rng, (m, k)), "b": bf16(rng, (n, k), max(k, 1) ** -0.5)}


GEMM_CASES = (
  Case("random", gemm),
  Case("nan_and_inf_in_a", lambda r: put(x := gemm(r), a=poison_rows(poison_rows(x["a"], [3]), [7], INF))),
  Case("m0", lambda r: gemm(r, m=0)),
  Case("m1_n1_k1", lambda r: gemm(r, 1, 1, 1)),
  Case("small_k8", lambda r: gemm(r, 16, 24, 8)),
  Case("m64_k48", lambda r: gemm(r, 64, 40, 48)),  # any K 24-48 with M a power of two
)


def router(rng, m=5, d=96, e=24):
  return {"hidden": bf16(rng, (m, d)), "weight": bf16(rng, (e, d), d**-0.5), "bias": f32(rng.standard_normal(e) * 0.05)}


def router_ties(rng):
  x = router(rng)
  w = np.array(x["weight"], np.float32)
  w[[3, 9, 17]] = w[5]  # equal scores: ties go to the lower id
  return put(x, weight=jnp.asarray(w, jnp.bfloat16), bias=jnp.zeros(24, jnp.float32))


ROUTER_CASES = (
  Case("random", router),
  Case("exact_ties", router_ties),
  Case("nan_hidden_row", lambda r: put(x := router(r), hidden=poison_rows(x["hidden"], [1]))),
  Case("inf_hidden_row", lambda r: put(x := router(r), hidden=poison_rows(x["hidden"], [2], INF))),
  Case("nan_weight_row", lambda r: put(x := router(r), weight=poison_rows(x["weight"], [7]))),
  Case("m0", lambda r: router(r, m=0)),
  Case("m1_topk_equals_e", lambda r: router(r, m=1, e=6)),
)


def grouped(rng, m=10, e=4, n=32, k=64, ids=None):
  a, a_scale = quantize_fp8(f32(rng.standard_normal((m, k))), 32)
  b, b_scale = quantize_e2m1(f32(rng.standard_normal((e, n, k)) / np.sqrt(k)), 32)
  ids = np.sort(rng.integers(0, e, m)) if ids is None else np.asarray(ids)
  return {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "expert_ids": i32(ids)}


def grouped_ids(rng, ids_fn, **kw):
  """Grouped operands whose expert ids `ids_fn(rng, sorted ids)` rewrites."""
  x = grouped(rng, **kw)
  return put(x, expert_ids=i32(ids_fn(rng, np.array(x["expert_ids"]))))


def only_valid(x: Inputs, name: str, hi) -> Inputs:
  """x with the entries of `name` outside [0, hi) made -1 (padding)."""
  ids = x[name]
  return put(x, **{name: jnp.where((ids >= 0) & (ids < hi), ids, -1)})


def some(rng, n, count=3):
  return rng.choice(n, size=count, replace=False)


def set_at(values, rows, value):
  out = np.array(values)
  out[rows] = value
  return out


def grouped_poisoned(rng):
  """-1 and out-of-range rows whose activations are NaN."""
  x = grouped(rng)
  rows = some(rng, 10, 4)
  ids = set_at(x["expert_ids"], rows, [-1, -1, 4, -3])
  a = np.array(x["a"].astype(jnp.float32))
  a[rows] = NAN
  poisoned = put(x, expert_ids=i32(ids), a=jnp.asarray(a, jnp.float8_e4m3fn))
  return poisoned, put(x, expert_ids=i32(ids))


GROUPED_CASES = (
  Case("sorted", grouped),
  Case("unsorted", lambda r: grouped_ids(r, lambda r, ids: r.permutation(ids))),  # [3,0,2,0,1,-1]
  Case("issue_row", lambda r: grouped(r, m=6, ids=[3, 0, 2, 0, 1, -1])),
  Case("padding_rows", lambda r: grouped_ids(r, lambda r, ids: set_at(ids, some(r, 10), -1))),
  Case("all_padding", lambda r: grouped_ids(r, lambda r, ids: -np.ones_like(ids))),
  Case("m0", lambda r: grouped(r, m=0)),
  Case("m1_e1", lambda r: grouped(r, m=1, e=1)),
  Case(
    "id_past_e",
    lambda r: grouped_ids(r, lambda r, ids: set_at(ids, some(r, 10, 2), [4, 7])),
    "invalid",
    "expert_ids",
    lambda x: only_valid(x, "expert_ids", 4),
  ),
  Case(
    "negative_id",
    lambda r: grouped_ids(r, lambda r, ids: set_at(ids, some(r, 10, 2), [-5, -2])),
    "invalid",
    "expert_ids",
    lambda x: only_valid(x, "expert_ids", 4),
  ),
  Case("nan_in_padding_rows", grouped_poisoned, "masked", "expert_ids"),
  Case("nan_in_a_used_row", lambda r: put(x := grouped(r), a=poison_rows(x["a"], [2]).astype(jnp.float8_e4m3fn))),
)


def ste(rng, m=10, e=4, n=32, k=64, ids=None):
  """The straight-through GEMM's unquantized operands: x bf16, master weights f32."""
  x = bf16(rng, (m, k))
  w = f32(rng.standard_normal((e, n, k)) / np.sqrt(k))
  ids = np.sort(rng.integers(0, e, m)) if ids is None else np.asarray(ids)
  return {"x": x, "w": w, "expert_ids": i32(ids)}


def ste_poisoned(rng):
  """-1 and out-of-range rows whose activations are NaN (their scales too, once quantized)."""
  x = ste(rng)
  rows = some(rng, 10, 4)
  ids = i32(set_at(x["expert_ids"], rows, [-1, -1, 4, -3]))
  clean = put(x, expert_ids=ids)
  return {**clean, "x": poison_rows(x["x"], rows)}, clean


STE_CASES = (
  Case("sorted", ste),
  Case(
    "unsorted_with_padding",
    lambda r: put(x := ste(r), expert_ids=i32(set_at(r.permutation(x["expert_ids"]), [1, 6], -1))),
  ),
  Case("m0", lambda r: ste(r, m=0)),
  Case("m1_e1", lambda r: ste(r, m=1, e=1)),
  Case(
    "id_past_e",
    lambda r: put(x := ste(r), expert_ids=i32(set_at(x["expert_ids"], some(r, 10, 2), [4, 9]))),
    "invalid",
    "expert_ids",
    lambda x: only_valid(x, "expert_ids", 4),
  ),
  Case("nan_in_padding_rows", ste_poisoned, "masked", "expert_ids"),
)


# ---------------------------------------------------------------------------
# Attention (three ops, one kernel) and 3-D neighborhood attention.


def attn(rng, b=2, nq=20, nk=24, h=2, d=64, holes=True):
  valid = rng.random((b, nk)) < 0.7 if holes else np.ones((b, nk), bool)
  return {
    "q": bf16(rng, (b, nq, h, d)),
    "k": bf16(rng, (b, nk, h, d)),
    "v": bf16(rng, (b, nk, h, d)),
    "key_valid": jnp.asarray(valid),
  }


def attn_masked_nan(rng):
  x = attn(rng)
  hidden = ~np.asarray(x["key_valid"])[..., None, None]
  poison = {n: jnp.where(hidden, jnp.asarray(NAN if n == "v" else INF, x[n].dtype), x[n]) for n in ("k", "v")}
  return put(x, **poison), x


def attn_lonely(rng):
  x = attn(rng)
  return put(x, key_valid=x["key_valid"].at[1].set(False))


ATTENTION_CASES = (
  Case("random_key_masks", attn),
  Case("lonely_batch_row", attn_lonely),
  Case("nan_inf_behind_key_valid", attn_masked_nan, "masked"),
  Case("nan_in_visible_value", lambda r: put(x := attn(r, holes=False), v=poison_rows(x["v"], [5], axis=1))),
  Case("traced_sm_scale", lambda r: put(attn(r), sm_scale=f32(0.07))),
  Case("b0", lambda r: attn(r, b=0)),
  Case("nq1_nk1", lambda r: attn(r, nq=1, nk=1, holes=False)),
  Case("nk0", lambda r: attn(r, nk=0)),
)


def prefix(rng, b=2, nq=12, np_=8, h=2, d=64):
  x = attn(rng, b, nq, nq, h, d)
  del x["key_valid"]
  return put(x, k_prefix=bf16(rng, (b, np_, h, d)), v_prefix=bf16(rng, (b, np_, h, d)))


PREFIX_CASES = (
  Case("random", prefix),
  Case("np0", lambda r: prefix(r, np_=0)),
  Case("b0", lambda r: prefix(r, b=0)),
  Case("nan_in_prefix_value", lambda r: put(x := prefix(r), v_prefix=poison_rows(x["v_prefix"], [3], axis=1))),
)


def segments(rng, b=2, n=20, sorted_ids=True):
  ids = np.sort(rng.integers(0, 4, (b, n)), axis=1)
  if not sorted_ids:
    ids = rng.permuted(ids, axis=1)
  x = attn(rng, b, n, n)
  del x["key_valid"]
  return put(x, segment_ids=i32(ids))


def segments_later_nan(rng):
  """NaN values in each batch row's last segment: earlier segments never see
  them. Its own queries, which do, are NaN in the clean inputs too."""
  x = segments(rng)
  ids = np.asarray(x["segment_ids"])
  last = (ids == ids[:, -1:])[..., None, None]
  nan = jnp.asarray(NAN, x["v"].dtype)
  x = put(x, q=jnp.where(last, nan, x["q"]))
  return put(x, v=jnp.where(last, nan, x["v"])), x


BLOCK_CAUSAL_CASES = (
  Case("random_segments", segments),
  Case("one_segment", lambda r: put(x := segments(r), segment_ids=jnp.zeros_like(x["segment_ids"]))),
  Case("b0", lambda r: segments(r, b=0)),
  Case("n1", lambda r: segments(r, n=1)),
  Case("unsorted_segments", lambda r: segments(r, sorted_ids=False), "invalid", "segment_ids"),
  Case("nan_in_a_later_segment", segments_later_nan, "masked"),
)


def natten(rng, shape=(1, 4, 6, 7, 1, 64)):
  return {"q": bf16(rng, shape, 0.125), "k": bf16(rng, shape), "v": bf16(rng, shape)}


NATTEN_CASES = (
  Case("random", natten),
  Case("grid_equals_window", lambda r: natten(r, (1, 3, 3, 5, 1, 64))),
  Case("b0", lambda r: natten(r, (0, 4, 6, 7, 1, 64))),
  Case("nan_in_one_value", lambda r: put(x := natten(r), v=x["v"].at[0, 0, 0, 0].set(NAN))),
)


# ---------------------------------------------------------------------------
# Gated delta net.


def gdn_tokens(rng, lead, hq=1, hv=2, d=128):
  return {
    "q": bf16(rng, (*lead, hq, d), d**-0.5),
    "k": bf16(rng, (*lead, hq, d), d**-0.5),
    "v": bf16(rng, (*lead, hv, d)),
    "a": bf16(rng, (*lead, hv)),
    "b": bf16(rng, (*lead, hv)),
    "A_log": f32(rng.uniform(0, 2, hv)),
    "dt_bias": f32(rng.uniform(-5, -2, hv)),
  }


def decode(rng, batch=3, hv=2, d=128):
  x = gdn_tokens(rng, (batch, 1), hv=hv, d=d)
  return put(x, state=f32(rng.standard_normal((batch, hv, d, d)) * 0.5))


DECODE_CASES = (
  Case("random", decode),
  Case("b0", lambda r: decode(r, batch=0)),
  Case("b1", lambda r: decode(r, batch=1)),
  Case("nan_in_one_row", lambda r: put(x := decode(r), v=x["v"].at[1].set(NAN))),
)


def prefill(rng, lengths=(5, 0, 9), cu=None, hv=2, d=128):
  total = int(sum(lengths))
  x = gdn_tokens(rng, (total,), hv=hv, d=d)
  cu = np.concatenate([[0], np.cumsum(lengths)]) if cu is None else np.asarray(cu)
  return put(x, state=f32(rng.standard_normal((len(cu) - 1, hv, d, d)) * 0.5), cu_seqlens=i32(cu))


def prefill_uncovered_nan(rng):
  """cu_seqlens ending before T: the uncovered tokens (NaN) reach nothing."""
  x = prefill(rng, lengths=(5, 0, 9), cu=[0, 5, 5, 10])
  return put(x, q=poison_rows(x["q"], [11, 13]), v=poison_rows(x["v"], [10, 12])), x


PREFILL_CASES = (
  Case("random", prefill),
  Case("t0", lambda r: prefill(r, lengths=(0, 0))),
  Case("one_token", lambda r: prefill(r, lengths=(1,))),
  Case(
    "cu_past_t",
    lambda r: prefill(r, cu=[0, 5, 5, 20]),
    "invalid",
    "cu_seqlens",
    lambda x: put(x, cu_seqlens=i32([0, 5, 5, 14])),
  ),
  Case(
    "cu_decreasing",
    lambda r: prefill(r, cu=[0, 9, 3, 14]),
    "invalid",
    "cu_seqlens",
    lambda x: put(x, cu_seqlens=i32([0, 9, 9, 14])),
  ),
  Case(
    "cu_negative_start",
    lambda r: prefill(r, cu=[-4, 5, 5, 14]),
    "invalid",
    "cu_seqlens",
    lambda x: put(x, cu_seqlens=i32([0, 5, 5, 14])),
  ),
  Case("nan_in_uncovered_tokens", prefill_uncovered_nan, "masked", "cu_seqlens"),
)


# ---------------------------------------------------------------------------
# Sparse and mixed MLA: invalid slots and the rows behind them.


def slot_indices(rng, shape, rows, invalid=0.25, bad=()):
  """Indices of rows [1, rows - 1) (rows 0 and rows - 1 stay unread), about
  `invalid` of them -1 (or the `bad` values, the first slot one of them),
  duplicates allowed."""
  idx = rng.integers(1, max(rows - 1, 2), shape)
  empty = rng.random(shape) < invalid
  fill = rng.choice(bad, shape) if bad else np.full(shape, -1)
  idx = np.where(empty, fill, idx)
  if bad and idx.size:
    idx.reshape(-1)[0] = bad[0]  # at least one
  return i32(idx)


def smla(rng, m=4, nkv=40, topk=64, h=16, d=128, **kw):
  return {
    "q": bf16(rng, (m, h, d)),
    "kv": bf16(rng, (nkv, d)),
    "indices": slot_indices(rng, (m, topk), nkv, **kw),
    "attn_sink": f32(rng.uniform(-2, 4, h)),
  }


def smla_poisoned(rng, bad=()):
  x = smla(rng, bad=bad)
  return put(x, kv=poison_rows(poison_rows(x["kv"], [0]), [39], INF)), x


SPARSE_MLA_CASES = (
  Case("random", smla),
  Case("lonely_rows", lambda r: put(x := smla(r), indices=x["indices"].at[:2].set(-1))),
  Case("one_row_everywhere", lambda r: put(x := smla(r), indices=jnp.full_like(x["indices"], 7))),
  Case("m0", lambda r: smla(r, m=0)),
  Case("m1", lambda r: smla(r, m=1)),
  Case(
    "index_past_nkv",
    lambda r: smla(r, bad=(40, 41, 1000)),
    "invalid",
    "indices",
    lambda x: only_valid(x, "indices", 40),
  ),
  Case(
    "negative_index",
    lambda r: smla(r, bad=(-2, -40, -1000)),
    "invalid",
    "indices",
    lambda x: only_valid(x, "indices", 40),
  ),
  Case("nan_behind_invalid_slots", smla_poisoned, "masked"),
  Case("nan_behind_out_of_range_slots", lambda r: smla_poisoned(r, bad=(40, -2)), "masked", "indices"),
)


def mmla(rng, b=2, h=16, d=128, n8=2, p8=16, n4=3, p4=8, k8=16, k4=32, bad=()):
  t8 = jnp.asarray(rng.standard_normal((n8, p8, 1, d)), jnp.bfloat16)
  t4 = jnp.asarray(rng.standard_normal((n4, p4, 1, d)), jnp.bfloat16)
  return {
    "q": bf16(rng, (b, h, d)),
    "kv_fp8": quantize_fp8_tokens(t8),
    "indices_fp8": slot_indices(rng, (b, k8), n8 * p8, bad=bad),
    "kv_fp4": quantize_fp4_tokens(t4),
    "indices_fp4": slot_indices(rng, (b, k4), n4 * p4, bad=bad),
    "attn_sink": f32(rng.standard_normal(h)),
  }


def poison_records(cache):
  """The first and last token records all 0xFF bytes: NaN FP8 values and
  scales, -inf FP4 values."""
  flat = cache.reshape(-1, cache.shape[-1])
  return flat.at[jnp.array([0, flat.shape[0] - 1])].set(255).reshape(cache.shape)


def mmla_poisoned(rng, bad=()):
  x = mmla(rng, bad=bad)
  return put(x, kv_fp8=poison_records(x["kv_fp8"]), kv_fp4=poison_records(x["kv_fp4"])), x


MIXED_MLA_CASES = (
  Case("random", mmla),
  Case(
    "lonely_row",
    lambda r: put(x := mmla(r), indices_fp8=x["indices_fp8"].at[0].set(-1), indices_fp4=x["indices_fp4"].at[0].set(-1)),
  ),
  Case("b0", lambda r: mmla(r, b=0)),
  Case("b1", lambda r: mmla(r, b=1)),
  Case(
    "index_past_cache",
    lambda r: mmla(r, bad=(32, 33, 1000)),
    "invalid",
    "indices_fp8",
    lambda x: only_valid(only_valid(x, "indices_fp8", 32), "indices_fp4", 24),
  ),
  Case(
    "negative_index",
    lambda r: mmla(r, bad=(-2, -1000)),
    "invalid",
    "indices_fp8",
    lambda x: only_valid(only_valid(x, "indices_fp8", 32), "indices_fp4", 24),
  ),
  Case("nan_behind_invalid_slots", mmla_poisoned, "masked"),
  Case("nan_behind_out_of_range_slots", lambda r: mmla_poisoned(r, bad=(-5, 24, 10**6)), "masked", "indices_fp8"),
)


# ---------------------------------------------------------------------------
# QSA: page tables, lengths, selected blocks.


def page_table(rng, batch, max_pages, num_pages):
  """Distinct random pages of [1, NP - 1) (pages 0 and NP - 1 stay unread)."""
  return i32(rng.permutation(np.arange(1, num_pages - 1))[: batch * max_pages].reshape(batch, max_pages))


def unread(table, tokens, page, num_pages):
  """bool [NP, P]: slots no sequence reads (its first `tokens` slots)."""
  mask = np.ones((num_pages, page), bool)
  for row, n in zip(np.asarray(table), np.asarray(tokens)):
    for t in range(max(0, min(int(n), row.size * page))):
      mask[row[t // page], t % page] = False
  return mask


def qidx(rng, seq_lens=(2150, 700), max_pages=34, num_pages=70):
  b = len(seq_lens)
  return {
    "q": bf16(rng, (b, 4, 128)),
    "index_k": bf16(rng, (num_pages, 16, 1, 128)),
    "page_table": page_table(rng, b, max_pages, num_pages),
    "seq_lens": i32(seq_lens),
  }


def qidx_poisoned(rng, **changes):
  x = put(qidx(rng), **changes)
  mask = unread(x["page_table"], np.clip(np.asarray(x["seq_lens"]) // 4, 0, None), 16, 70)
  return put(x, index_k=jnp.where(mask[:, :, None, None], jnp.asarray(NAN, jnp.bfloat16), x["index_k"])), x


def with_entry(x, b, j, value):
  return put(x, page_table=x["page_table"].at[b, j].set(value))


QSA_INDEX_CASES = (
  Case("random", qidx),
  Case("short_and_empty", lambda r: qidx(r, seq_lens=(3, 0))),
  Case("unused_entries_garbage", lambda r: with_entry(qidx(r), 1, slice(11, None), -7)),
  Case("b0", lambda r: qidx(r, seq_lens=())),
  Case("entry_past_np", lambda r: with_entry(qidx(r), 0, 4, 70), "invalid", "page_table"),
  Case("negative_entry", lambda r: with_entry(qidx(r), 1, 2, -1), "invalid", "page_table"),
  Case(
    "seq_len_past_table",
    lambda r: qidx(r, seq_lens=(10**6, 700)),
    "invalid",
    "seq_lens",
    lambda x: put(x, seq_lens=i32([34 * 16 * 4, 700])),
  ),
  Case("table_narrower_than_topk", lambda r: qidx(r, seq_lens=(300, 30), max_pages=5, num_pages=12)),
  Case(
    "seq_len_past_narrow_table",
    lambda r: qidx(r, seq_lens=(10**6, 30), max_pages=5, num_pages=12),
    "invalid",
    "seq_lens",
    lambda x: put(x, seq_lens=i32([5 * 16 * 4, 30])),
  ),  # ids beyond the table
  Case(
    "negative_seq_len",
    lambda r: qidx(r, seq_lens=(2150, -9)),
    "invalid",
    "seq_lens",
    lambda x: put(x, seq_lens=i32([2150, 0])),
  ),
  Case("nan_in_unread_keys", qidx_poisoned, "masked"),
)


def qgqa(rng, seq_lens=(150, 70), max_pages=3, num_pages=8, topk=512, ids=None):
  b = len(seq_lens)
  if ids is None:
    ids = -np.ones((b, topk), np.int64)
    for i, n in enumerate(np.asarray(seq_lens) // 4):
      chosen = np.sort(rng.permutation(n)[: rng.integers(0, n + 1)])
      ids[i, : len(chosen)] = chosen
  return {
    "q": bf16(rng, (b, 4, 64)),
    "k_cache": bf16(rng, (num_pages, 64, 2, 64)),
    "v_cache": bf16(rng, (num_pages, 64, 2, 64)),
    "page_table": page_table(rng, b, max_pages, num_pages),
    "seq_lens": i32(seq_lens),
    "topk_ids": i32(ids),
  }


def rewrite_ids(x, fn, rng):
  return put(x, topk_ids=i32(fn(rng, np.array(x["topk_ids"]))))


def duplicated(rng, ids):
  ids[:, 20:30] = ids[:, :10]
  return ids


def gqa_poisoned(rng):
  """NaN in every cache slot that no visible token occupies."""
  x = qgqa(rng)
  ids, lens = np.asarray(x["topk_ids"]), np.asarray(x["seq_lens"])
  mask = np.ones((8, 64), bool)
  for row, n, sel in zip(np.asarray(x["page_table"]), lens, ids):
    blocks = set(int(i) for i in sel if i >= 0) | {n // 4}
    for t in range(n):
      if t // 4 in blocks:
        mask[row[t // 64], t % 64] = False
  nan = jnp.asarray(NAN, jnp.bfloat16)
  m = mask[:, :, None, None]
  return put(x, k_cache=jnp.where(m, nan, x["k_cache"]), v_cache=jnp.where(m, nan, x["v_cache"])), x


QSA_GQA_CASES = (
  Case("random", qgqa),
  Case("unsorted_ids", lambda r: rewrite_ids(qgqa(r), lambda r, ids: r.permuted(ids, axis=1), r)),
  Case("duplicate_ids", lambda r: rewrite_ids(qgqa(r), duplicated, r)),
  Case("tail_only", lambda r: qgqa(r, seq_lens=(3, 2), ids=-np.ones((2, 512)))),
  Case("b0", lambda r: qgqa(r, seq_lens=())),
  Case(
    "id_past_blocks",
    lambda r: rewrite_ids(qgqa(r), lambda r, ids: set_at(ids, (0, 511), 40), r),
    "invalid",
    "topk_ids",
    lambda x: put(x, topk_ids=x["topk_ids"].at[0, 511].set(-1)),
  ),
  Case(
    "negative_id",
    lambda r: rewrite_ids(qgqa(r), lambda r, ids: set_at(ids, (1, 500), -3), r),
    "invalid",
    "topk_ids",
    lambda x: put(x, topk_ids=x["topk_ids"].at[1, 500].set(-1)),
  ),
  Case("entry_past_np", lambda r: with_entry(qgqa(r), 0, 1, 8), "invalid", "page_table"),
  Case(
    "seq_len_past_table",
    lambda r: qgqa(r, seq_lens=(10**6 + 3, 70), ids=np.tile(np.arange(512), (2, 1)) % 17),
    "invalid",
    "seq_lens",
    lambda x: put(x, seq_lens=i32([3 * 64, 70])),
  ),
  Case("nan_in_invisible_tokens", gqa_poisoned, "masked"),
)


# ---------------------------------------------------------------------------
# The targets.


def _kw(*names):
  """call(inputs, **options) with `names` passed positionally, the rest by keyword."""

  def call(fn):
    def run(x: Mapping[str, Any], **options):
      rest = {k: v for k, v in x.items() if k not in names}
      return fn(*(x[n] for n in names), **rest, **options)

    return run

  return call


TARGETS = (
  Target("dense_gemm", "grad", dense_gemm.IMPL, _kw("a", "b")(ops.dense_gemm), GEMM_CASES),
  Target("moe_router", "grouped", moe_router.IMPL, _kw("hidden", "weight", "bias")(ops.moe_router), ROUTER_CASES),
  Target("grouped_gemm_fp8_fp4", "grouped", grouped_gemm.IMPL, _kw()(ops.grouped_gemm_fp8_fp4), GROUPED_CASES),
  Target("grouped_gemm_mxfp4_ste", "moenn", grouped_gemm.IMPL, _kw()(ops.grouped_gemm_mxfp4_ste), STE_CASES),
  Target("attention", "grad", flash_attention.NONCAUSAL, _kw("q", "k", "v")(ops.attention), ATTENTION_CASES),
  Target(
    "prefix_cached_attention", "grad", flash_attention.PREFIX_CACHED, _kw()(ops.prefix_cached_attention), PREFIX_CASES
  ),
  Target(
    "block_causal_attention",
    "grad",
    flash_attention.BLOCK_CAUSAL,
    _kw()(ops.block_causal_attention),
    BLOCK_CAUSAL_CASES,
  ),
  Target(
    "neighborhood_attention_3d",
    "grad",
    neighborhood_attention.IMPL,
    lambda x, **o: ops.neighborhood_attention_3d(**x, kernel_size=(3, 3, 5), **o),
    NATTEN_CASES,
  ),
  Target("gdn_decode", "gdn", gdn_decode.IMPL, _kw()(ops.gdn_decode), DECODE_CASES),
  Target("gdn_prefill", "gdn", gdn_prefill.IMPL, _kw()(ops.gdn_prefill), PREFILL_CASES),
  Target("sparse_mla_prefill", "mla", sparse_mla.IMPL, _kw()(ops.sparse_mla_prefill), SPARSE_MLA_CASES),
  Target("mixed_mla_decode", "mla", mixed_mla.IMPL, _kw()(ops.mixed_mla_decode), MIXED_MLA_CASES),
  Target("qsa_index_topk", "qsa", qsa_index.IMPL, _kw()(ops.qsa_index_topk), QSA_INDEX_CASES),
  Target("qsa_sparse_gqa_decode", "qsa", qsa_sparse_gqa.IMPL, _kw()(ops.qsa_sparse_gqa_decode), QSA_GQA_CASES),
)
