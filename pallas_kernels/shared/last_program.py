"""The last program of a group: finishing work inside the launch that made
its inputs, on the Triton lowering (no grid-wide barrier there).

A group is a set of programs of one launch (e.g. the programs of one row of
the grid) that each write a part of a result to global memory; one of them
must then combine the parts. Instead of a second launch, every program
arrives at the group's counter once it has written its part,

    ticket = arrive(counter_ref, idx, interpret=...)

and the program whose `ticket` is `group_size - 1` (the last to arrive) does
the combining, under `pl.when(ticket == group_size - 1)`. The counter must
be zero when the launch starts (a zeroed operand aliased to an output, or
zeroed by an earlier launch).

Memory ordering (the PTX memory model; the pattern is CUTLASS's semaphore
and Triton's split-K "serial" reduction):

1. A program's parts are written by all its threads; `arrive` first runs a
   CTA barrier (`bar.sync`, `plgpu.debug_barrier`), which orders every
   thread's earlier global stores and atomics before what thread 0 does
   next.
2. The arrival is one scalar `atom.add.acq_rel.gpu` (Pallas Triton's atomics
   are acquire-release at GPU scope; Triton issues a scalar atomic from one
   thread and broadcasts its result through shared memory behind a
   barrier). Its release half makes the program's parts (ordered before it
   by step 1, cumulatively) visible at GPU scope to whoever acquires a later
   value of the counter.
3. The counter's atomics form one modification order, so the program that
   reads `group_size - 1` comes after every other program's release; its
   acquire half (then the broadcast barrier, which orders the other threads
   of that CTA after thread 0) makes every part visible to all its threads'
   subsequent loads, which therefore see the parts rather than stale L1
   lines (an acquire at GPU scope invalidates the SM's L1).

Only the last program reads the parts, and nothing writes them after its
ticket, so there is no other race. Parts accumulated with atomics (counts
added by every program) are covered the same way.

Interpret mode runs the programs one after another in grid order with
exact atomics (SPEC 2), so the last program of a group there is its last in
grid order, and everything it reads is already written: the barrier is not
needed and has no interpret rule, so it is only emitted for the GPU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def arrive(counter_ref, idx: Any, *, interpret: bool) -> jax.Array:
  """Counts this program in at `counter_ref[idx]` (int32, zero at launch),
  after its earlier stores; returns the count before it (the ticket: 0 for
  the first program, `group_size - 1` for the last)."""
  if not interpret:
    plgpu.debug_barrier()
  return plgpu.atomic_add(counter_ref, idx, jnp.ones((), jnp.int32))


def add_nonzero(ref, idx: Any, values: jax.Array, *, interpret: bool) -> None:
  """`ref[idx] += values` atomically; on the GPU only the nonzero values are
  sent (a masked atomic: a sparse histogram costs its few nonzero bins, not
  all of them). Interpret mode has no masked atomics (SPEC 2) and adds
  everything: the same sums."""
  plgpu.atomic_add(ref, idx, values, mask=None if interpret else values != 0)
