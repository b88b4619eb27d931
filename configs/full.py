"""The GPU run: all 1104 workloads at their recorded sizes, no interpret mode."""

from jaxkern.replay_config import default_config


def get_config():
  c = default_config()
  c.scale = "full"
  c.interpret = False
  c.warmup = 3
  c.iters = 10
  c.output = "results/full.jsonl"
  return c
