"""Default replay: every definition and every recorded variant, sized for the
machine it runs on (recorded sizes on a GPU; shrunk, in interpret mode, on a
CPU). Fields and their meaning: `jaxkern.replay_config`."""

from jaxkern.replay_config import default_config


def get_config():
  c = default_config()
  # Records sharing a variant differ mostly in step and seed: one of each keeps
  # every recorded structure and fits a CPU run in minutes.
  c.max_workloads_per_variant = 1
  c.output = "results/replay.jsonl"
  return c
