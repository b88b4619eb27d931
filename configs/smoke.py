"""Tiny, for CI: one workload per definition at CPU-budget sizes, one timed run."""

from jaxkern.replay_config import default_config


def get_config():
  c = default_config()
  c.max_workloads_per_definition = 1
  c.scale = "smoke"
  c.warmup = 0
  c.iters = 1
  c.timeout_s = 300.0
  c.output = "results/smoke-{time}.jsonl"  # a new file per run, under the working directory
  return c
