"""The GPU run: all 1104 workloads at their recorded sizes, no interpret mode."""

from jaxkern.replay_config import default_config


def get_config():
  c = default_config()
  c.scale = "full"
  c.max_workloads_per_variant = 0
  c.interpret = False
  c.warmup = 3
  c.iters = 10
  c.output = "results/full-{time}.jsonl"  # a new file per run, under the working directory
  return c
