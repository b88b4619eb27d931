"""Gated delta net decode step, Qwen3-Next layout with a k-last state (SPEC
4.8): `gdn_decode_qk4_v8_d128_k_last`.

Per token t and v-head h (q/k head h // (HV // HQ)), with S viewed as [K, V]
(stored k-last as [V, K]):
  g = exp(-exp(A_log[h]) * softplus(a[t,h] + dt_bias[h])), beta = sigmoid(b[t,h]);
  S = g S;  S = S + k (beta (v - S^T k))^T;  o = scale * S^T q (updated S).
All math fp32, output rounded once to bf16, new_state fp32, scale 0 ->
1/sqrt(head_size). Kernel: `pallas_kernels.gdn_decode`. The prefill
(`jaxkern.families.gdn_prefill`) shares the reference math and the token
synthesis defined here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.gdn_decode import KERNELS

# ------------------------------------------------------------------ references


def softplus(x):
  """torch.nn.functional.softplus (beta 1): x itself above the threshold 20."""
  return jnp.where(x > 20.0, x, jax.nn.softplus(x))


def gates(a, b, A_log, dt_bias):
  """(g, beta) fp32, shaped like `a`: decay g = exp(-exp(A_log) *
  softplus(a + dt_bias)) in (0, 1], update gate beta = sigmoid(b) in (0, 1).
  The reference's own gate math (not the kernel's), so that a gate bug in the
  kernel cannot pass its own check."""
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  g = jnp.exp(-jnp.exp(f32(A_log)) * softplus(f32(a) + f32(dt_bias)))
  return g, jax.nn.sigmoid(f32(b))


def resolve_scale(scale, head_size: int) -> jax.Array:
  """0-d fp32: `scale`, or 1/sqrt(head_size) where it is 0 (the definition's
  default)."""
  scale = jnp.asarray(scale, jnp.float32).reshape(())
  return jnp.where(scale == 0.0, jnp.float32(head_size) ** -0.5, scale)


def per_v_head(x, num_v_heads: int):
  """[..., HQ, D] -> fp32 [..., HV, D]: v-head h reads q/k head h // (HV // HQ)."""
  return jnp.repeat(x.astype(jnp.float32), num_v_heads // x.shape[-2], axis=-2)


def delta_step(s, q, k, v, g, beta, scale):
  """One token for a batch of states: s [..., V, K] k-last, q/k/v [..., D],
  g/beta [...]. Returns (new s, output [..., V]). Elementwise products and
  sums only (exact fp32 on every backend, no matmul precision setting)."""
  s = s * g[..., None, None]
  predicted = jnp.sum(s * k[..., None, :], axis=-1)  # (S^T k)[v]
  u = beta[..., None] * (v - predicted)
  s = s + u[..., :, None] * k[..., None, :]
  return s, scale * jnp.sum(s * q[..., None, :], axis=-1)


def gdn_decode_reference(q, k, v, state, A_log, a, dt_bias, b, scale):
  """q, k [B,1,HQ,D], v [B,1,HV,D], state [B,HV,V,K] f32 -> (output [B,1,HV,D]
  bf16, new_state [B,HV,V,K] f32)."""
  hv, d = v.shape[-2:]
  g, beta = gates(a[:, 0], b[:, 0], A_log, dt_bias)  # [B, HV]
  s, o = delta_step(
    state.astype(jnp.float32),
    per_v_head(q[:, 0], hv),
    per_v_head(k[:, 0], hv),
    v[:, 0].astype(jnp.float32),
    g,
    beta,
    resolve_scale(scale, d),
  )
  return o[:, None].astype(jnp.bfloat16), s


# ------------------------------------------------------------------- synthesis

# Qwen3-Next's gate parameterization (its initialization, which training
# keeps in range): A = exp(A_log) ~ U(1, 16); dt_bias = softplus^-1(dt) with
# dt log-uniform in [1e-3, 1e-1]. With per-token `a` ~ N(0, 2^2) the decay
# g spans (0, 1): slow heads sit near 1, fast heads reach 1e-4 on large a.
_A_RANGE = (1.0, 16.0)
_DT_RANGE = (1e-3, 1e-1)
_A_STD = 2.0
_B_STD = 2.0  # beta = sigmoid(b) spread over (0, 1)
STATE_STD = 0.5  # moderate: S^T k ~ 0.5 per element for unit k, v ~ N(0, 1)


def _unit_rows(key, shape):
  x = jax.random.normal(key, shape, jnp.float32)
  return (x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))).astype(jnp.bfloat16)


def head_params(key, num_v_heads: int):
  k_a, k_dt = jax.random.split(key)
  A = jax.random.uniform(k_a, (num_v_heads,), jnp.float32, *_A_RANGE)
  log_dt = jax.random.uniform(k_dt, (num_v_heads,), jnp.float32, math.log(_DT_RANGE[0]), math.log(_DT_RANGE[1]))
  dt = jnp.exp(log_dt)
  dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt)
  return jnp.log(A), dt_bias


def token_inputs(key, lead: tuple[int, ...], hq: int, hv: int, d: int):
  kq, kk, kv, ka, kb = jax.random.split(key, 5)
  return {
    "q": _unit_rows(kq, (*lead, hq, d)),
    "k": _unit_rows(kk, (*lead, hq, d)),
    "v": jax.random.normal(kv, (*lead, hv, d), jnp.float32).astype(jnp.bfloat16),
    "a": (_A_STD * jax.random.normal(ka, (*lead, hv), jnp.float32)).astype(jnp.bfloat16),
    "b": (_B_STD * jax.random.normal(kb, (*lead, hv), jnp.float32)).astype(jnp.bfloat16),
  }


def gdn_inputs(keys, lead: tuple[int, ...], num_states: int, hq: int, hv: int, d: int) -> dict[str, jax.Array]:
  """The inputs both GDN definitions share, in their order (q, k, v, state,
  A_log, a, dt_bias, b), from three keys (tokens, heads, states): tokens
  `[*lead, H, D]` as `token_inputs`, gates as `head_params`, `num_states`
  k-last states N(0, STATE_STD^2)."""
  k_tok, k_head, k_state = keys
  tokens = token_inputs(k_tok, lead, hq, hv, d)
  A_log, dt_bias = head_params(k_head, hv)
  state = STATE_STD * jax.random.normal(k_state, (num_states, hv, d, d), jnp.float32)
  return {
    "q": tokens["q"],
    "k": tokens["k"],
    "v": tokens["v"],
    "state": state,
    "A_log": A_log,
    "a": tokens["a"],
    "dt_bias": dt_bias,
    "b": tokens["b"],
  }


def make_decode_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None):
  """Unit-norm q, k per head; v ~ N(0, 1); gates as `head_params`; state
  N(0, 0.5^2); scale 0 (the default 1/sqrt(128), as the contest records).
  Decode rows are independent: the record adds no structure."""
  del record
  batch, hq, hv, d = (int(axes[n]) for n in ("batch_size", "num_q_heads", "num_v_heads", "head_size"))
  inputs = gdn_inputs(jax.random.split(key, 3), (batch, int(axes["seq_len"])), batch, hq, hv, d)
  return {**inputs, "scale": jnp.zeros((), jnp.float32)}


# --------------------------------------------------------------- CPU budgets

_CPU_BATCH = 8  # decode rows at CPU scale


def decode_cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """batch_size capped at 8; heads and head_size kept (the GVA structure)."""
  out = dict(axes)
  out["batch_size"] = min(int(axes["batch_size"]), _CPU_BATCH)
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def gdn_flops(tokens: int, axes: Mapping[str, int]) -> int:
  """Per token and v-head, over the K x V state: decay (1 per element),
  k^T S (2), the rank-1 update (2), q^T S (2): 7 K V."""
  return 7 * tokens * axes["num_v_heads"] * axes["head_size"] * axes["head_size"]


def gdn_decode_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Gated delta rule, one token per sequence: FLOPs 7 B HV K V (see
  `gdn_flops`; the per-head gates are not counted), matrix-vector work on
  the FP32 (non-tensor-core) peak. Bytes: all inputs read once (the f32
  state [B,HV,K,V] dominates) and output and new_state written once."""
  return roofline.Work(
    gdn_flops(axes["batch_size"] * axes["seq_len"], axes), roofline.io_bytes(definition, axes), "fp32"
  )


# ------------------------------------------------------------------ registry

# How the op splits across devices (`jaxkern.spmd`): batch and heads (q/k
# heads with the v heads that read them: v head h reads q/k head h // (HV/HQ)).
SPLIT = Split(
  inputs={
    "q": "b o h dk",
    "k": "b o h dk",
    "v": "b o h dv",
    "state": "b h dv dk",
    "A_log": "h",
    "a": "b o h",
    "dt_bias": "h",
    "b": "b o h",
    "scale": "",
  },
  outputs=("b o h dv", "b h dv dk"),
  independent="b h",
  reasons={"dk": CONTRACTION, "dv": "the state's rows are updated from all of them"},
)
IMPL = OpImpl(
  reference=gdn_decode_reference,
  kernels=KERNELS,
  make_inputs=make_decode_inputs,
  cpu_axes=decode_cpu_axes,
  cost=gdn_decode_cost,
  split=SPLIT,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def check_gdn(c: Checks, q, k, v, state, A_log, a, dt_bias, b, sm_scale, *, lead: str, states: str) -> None:
  """The tensors both GDN ops share: q, k [*lead, HQ, D], v [*lead, HV, D]
  (HV a multiple of HQ), a, b [*lead, HV], A_log, dt_bias [HV], k-last
  states [<states>, HV, D, D], all floating (q, k one dtype); sm_scale None
  or a scalar. `lead` names the leading axes (`"B, 1"`, `"T"`)."""
  ndim = len(lead.split(","))
  c.rank("q", q, f"[{lead}, HQ, D]", ndim + 2)
  heads, head_dim = q.shape[-2:]
  lead_shape = tuple(q.shape[:-2])
  c.shape("k", k, q.shape, f"[{lead}, HQ, D]", "q's shape")
  c.shape("v", v, (*lead_shape, None, head_dim), f"[{lead}, HV, D]", f"{lead}, D from q")
  v_heads = v.shape[-2]
  if heads == 0 or v_heads % heads:
    c.fail("v", f"[{lead}, HV, D] with HV a multiple of HQ = {heads} (q.shape[-2])", f"shape {tuple(v.shape)}")
  for name, x in (("a", a), ("b", b)):
    c.shape(name, x, (*lead_shape, v_heads), f"[{lead}, HV]", f"{lead} from q, HV from v")
  for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
    c.shape(name, x, (v_heads,), "[HV]", "HV from v")
  c.rank("state", state, f"[{states}, HV, V, K]", 4)
  c.shape("state", state, (None, v_heads, head_dim, head_dim), f"[{states}, HV, V, K]", "HV from v, V = K = D from q")
  c.floating("q", q)
  c.same_dtype("k", k, "q", q)
  for name, x in (("v", v), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias), ("state", state)):
    c.floating(name, x)
  c.scalar("sm_scale", sm_scale, optional=True)


def validate(q, k, v, state, A_log, a, dt_bias, b, *, sm_scale=None, **_) -> None:
  """The contract of `gdn_decode` (`jaxkern.contract`): one token per sequence."""
  c = Checks("gdn_decode")
  c.rank("q", q, "[B, 1, HQ, D]", 4)
  c.shape("q", q, (None, 1, None, None), "[B, 1, HQ, D]", "one token per sequence")
  check_gdn(c, q, k, v, state, A_log, a, dt_bias, b, sm_scale, lead="B, 1", states="B")
  c.shape("state", state, (q.shape[0], *state.shape[1:]), "[B, HV, V, K]", "B from q")


@public_op(validate, was_positional=("sm_scale",), renamed={"scale": "sm_scale"})
def gdn_decode(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  state: jax.Array,
  A_log: jax.Array,
  a: jax.Array,
  dt_bias: jax.Array,
  b: jax.Array,
  *,
  sm_scale: float | jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Gated delta net decode step (Qwen3-Next): q, k [B, 1, HQ, D], v [B, 1, HV, D],
  k-last state [B, HV, V, K] f32, a, b [B, 1, HV], A_log, dt_bias [HV] f32;
  sm_scale None (or 0) -> D**-0.5. Returns (output [B, 1, HV, D] bf16, new_state
  [B, HV, V, K] f32).

  Contract: any B >= 0; HV a multiple of HQ; q, k, v, a, b bf16. Rows are
  independent and there are no index inputs (`checks=True` has nothing to
  check); non-finite values reach their own row's output and state.

  Backends: `xla`, `triton`."""
  inputs = dict(
    q=q,
    k=k,
    v=v,
    state=state,
    A_log=A_log,
    a=a,
    dt_bias=dt_bias,
    b=b,
    scale=jnp.asarray(0.0 if sm_scale is None else sm_scale, jnp.float32),
  )
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
