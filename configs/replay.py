"""Default replay: every definition and every recorded variant, sized for the
machine it runs on (recorded sizes on a GPU; shrunk, in interpret mode, on a
CPU). Fields and their meaning: `jaxkern.replay_config`."""

from jaxkern.replay_config import default_config


def get_config():
  c = default_config()
  # max_workloads_per_variant stays None: every record on a GPU (minutes
  # there); one per recorded variant on a CPU (records sharing a variant
  # differ mostly in step and seed), which fits interpret mode in minutes.
  c.output = "results/replay-{time}.jsonl"  # a new file per run, under the working directory
  return c
