"""What the training examples (`video_train`, `gdn_train`) share: Adam
steps on one fixed batch, and the command line's last line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def adam_losses(
  loss_fn: Callable[..., jax.Array],
  params: Any,
  batch: tuple,
  steps: int,
  learning_rate: float,
  log: Callable[[str], None] | None = None,
) -> list[float]:
  """`steps` Adam steps (one jitted step each) on `loss_fn(params, *batch)`;
  the loss before each step."""
  optimizer = optax.adam(learning_rate)

  @jax.jit
  def step(params, opt_state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, *batch)
    losses.append(float(loss))
    if log:
      log(f"step {i}: loss {losses[-1]:.5f}")
  return losses


def report(losses: list[float]) -> int:
  """Prints the first and last loss; the exit code: 0 if the loss went down."""
  decreased = len(losses) > 1 and losses[-1] < losses[0]
  print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} ({'decreasing' if decreased else 'NOT decreasing'})")
  return 0 if decreased else 1
