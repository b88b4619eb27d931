"""The replay config schema: every field, its default and meaning.

Config files in `configs/` start from `default_config()` and change values;
any field is overridable on the command line as `--config.FIELD=VALUE`.
(Kept apart from `jaxkern.replay` so config files do not import the app and
its flags.)
"""

from ml_collections import config_dict


def default_config() -> config_dict.ConfigDict:
  """Every replay config field, with its default."""
  c = config_dict.ConfigDict()
  c.dataset_dir = ""  # empty: the dataset shipped with the package (repository's datasets/)
  c.definitions = ""  # comma-separated names or name prefixes; empty = all
  c.variants = ""  # comma-separated recorded variants; empty = all ("none" = records without one)
  c.uuids = ""  # comma-separated uuids; empty = all
  c.max_workloads_per_definition = 0  # 0 = no cap
  # 0 = no cap; records without a variant form one group. None: no cap on a
  # GPU, 1 without one (interpret mode is slow; one per variant keeps every
  # recorded structure).
  c.max_workloads_per_variant = config_dict.placeholder(int)
  c.seed = 0  # mixed with each record's uuid
  c.scale = "auto"  # auto: recorded sizes on a GPU, CPU budget without one | full | smoke
  c.interpret = config_dict.placeholder(bool)  # None: interpret mode when no GPU is present
  c.blob_root = ""  # directory holding the records' blob/... safetensors, if any
  # The results file. {time}: the run's start (20261205-143012), a new file
  # per run. A fixed name is only ever appended to (resume), never replaced.
  c.output = "results/replay-{time}.jsonl"
  c.tuned = True  # consult configs/tuned/<device kind>.json before the heuristic
  c.backend = (
    "pallas"  # kernel backend: pallas (the best available: tuned, else the family's order) | triton | mosaic_gpu
  )
  # Append to `output` (a fixed name), skipping uuids already in it; without
  # it a non-empty `output` is an error.
  c.resume = False
  c.order = "dataset"  # dataset | interleave (round robin over definitions: a time-capped run covers all early)
  c.warmup = 1
  c.iters = 3  # timed calls (device timer: calls in one trace)
  c.cold_l2 = True  # GPU: the L2 is flushed before each timed call (flush not counted; see jaxkern.bench)
  c.timeout_s = 600.0  # per workload, compile included
  # process: each device's worker is a child process, killed and replaced when
  # a workload passes timeout_s (or crashes); none: in this process, where
  # timeout_s is only checked between a workload's steps (see jaxkern.workers).
  c.isolation = "process"
  c.progress = True  # a progress bar; False: one log line per workload
  # Several processes or hosts (see jaxkern.shards): with a coordinator,
  # jax.distributed.initialize runs first and the process's index and count
  # come from it (num_processes / process_id may stay 0 / -1 where the
  # cluster environment provides them); without one, process_id and
  # num_processes name this process's shard directly (e.g. to resume one).
  c.coordinator_address = ""
  c.num_processes = 0
  c.process_id = -1
  c.devices = "all"  # all: one worker per local device | first: device 0 only
  return c
