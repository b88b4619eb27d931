"""The command lines' help and quiet start: every argparse tool's `--help`
(each subcommand's too) gives every option a one-line meaning, with its
default where it has one; start-up noise stays off (`jaxkern.command_line`).
The absl tools' help is tested beside them (test_replay, test_sweep,
test_aot)."""

import argparse
import os

import pytest

from examples import gdn_train, moe_block, video_train
from jaxkern import command_line, peers, shards
from jaxkern.dataset import importer
from jaxkern.fib import cli as fib_cli
from jaxkern.report import cli as report_cli


def help_of(main, args, capsys):
  """What `main([*args, "--help"])` prints (argparse exits 0)."""
  with pytest.raises(SystemExit) as exit_info:
    main([*args, "--help"])
  assert exit_info.value.code == 0
  return capsys.readouterr().out


def options(text):
  """(option, its help) per option of an argparse help text: an option's
  help starts on its line after two spaces or on the next, deeper line."""
  lines = text.splitlines()
  out = []
  for i, line in enumerate(lines):
    stripped = line.strip()
    if not line.startswith("  ") or line.startswith("   ") or not stripped or stripped.startswith("{"):
      continue
    head, _, rest = stripped.partition("  ")
    if rest.strip():
      out.append((head, rest.strip()))
      continue
    following = lines[i + 1] if i + 1 < len(lines) else ""
    deeper = following.startswith("    ") and following.strip() and not following.strip().startswith("-")
    out.append((head, following.strip() if deeper else ""))
  return out


TOOLS = [
  (report_cli.main, [], ["results", "--baseline", "--out", "--dataset_dir", "--markdown"]),
  (fib_cli.main, ["export"], ["--out", "--dataset", "--results", "--definitions"]),
  (fib_cli.main, ["import"], ["dir", "--out"]),
  (importer.main, ["convert"], ["--input", "--output", "--definitions"]),
  (importer.main, ["validate"], ["--dataset"]),
  (importer.main, ["stats"], ["--dataset"]),
  (shards.main, ["merge"], ["inputs", "--output"]),
  (peers.main, [], ["--results", "--out", "--scale", "--warmup", "--iters", "--cold_l2", "--dataset_dir"]),
  (moe_block.main, [], ["--tokens", "--batch", "--backend", "--iters", "--devices"]),
  (gdn_train.main, [], ["--steps", "--learning-rate", "--backend"]),
  (video_train.main, [], ["--steps", "--batch", "--learning-rate", "--backend"]),
]


@pytest.mark.parametrize("main,args,expected", TOOLS, ids=lambda v: getattr(v, "__module__", None) or str(v))
def test_every_option_has_a_meaning_and_its_default(main, args, expected, capsys):
  found = dict(options(help_of(main, args, capsys)))
  for name in expected:
    head = next((h for h in found if h == name or h.startswith(name + " ") or h.startswith(name + ",")), None)
    assert head is not None, (name, sorted(found))
    meaning = found[head]
    assert meaning, f"{name} has no help"
  # An option with a default names it (store_true flags and required ones are
  # told by their help: "required", or a default stated in words).
  parser_defaults = {
    "--warmup": "(default: 1)",
    "--iters": "(default:",
    "--steps": "(default: 20)",
    "--scale": "(default: auto)",
    "--tokens": "(default: 64)",
  }
  text = " ".join(help_of(main, args, capsys).split())
  for name, default in parser_defaults.items():
    if name in expected:
      assert default in text, (name, text)


def test_subcommands_are_listed_with_a_meaning(capsys):
  for main, subcommands in ((fib_cli.main, ("export", "import")), (importer.main, ("convert", "validate", "stats"))):
    text = help_of(main, [], capsys)
    listing = text.split("positional arguments:")[1]
    for sub in subcommands:
      line = next(l for l in listing.splitlines() if l.strip().startswith(sub + " "))
      assert len(line.split()) > 1, line


def test_options_parser_reads_argparse_layout():
  parser = argparse.ArgumentParser(prog="p")
  parser.add_argument("--bare")
  parser.add_argument("--told", help="said here")
  parser.add_argument("--a_very_long_option_name_indeed", help="on the next line")
  found = dict(options(parser.format_help()))
  assert found["--bare BARE"] == "" and found["--told TOLD"] == "said here"
  assert found["--a_very_long_option_name_indeed A_VERY_LONG_OPTION_NAME_INDEED"] == "on the next line"


def test_quiet_cuda_probe_only_without_an_nvidia_device(monkeypatch):
  monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
  monkeypatch.setattr(command_line.glob, "glob", lambda pattern: ["/dev/nvidia0"])
  command_line.quiet_cuda_probe()
  assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in os.environ
  monkeypatch.setattr(command_line.glob, "glob", lambda pattern: [])
  command_line.quiet_cuda_probe()
  assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"


def test_quiet_absl_logging_keeps_an_explicit_verbosity(monkeypatch):
  from absl import flags, logging

  flags.FLAGS.mark_as_parsed()
  before = logging.get_verbosity()
  try:
    monkeypatch.setattr(flags.FLAGS["verbosity"], "present", 0)
    logging.set_verbosity(logging.INFO)
    command_line.quiet_absl_logging()
    assert logging.get_verbosity() == logging.WARNING
    monkeypatch.setattr(flags.FLAGS["verbosity"], "present", 1)
    logging.set_verbosity(logging.INFO)
    command_line.quiet_absl_logging()
    assert logging.get_verbosity() == logging.INFO
  finally:
    logging.set_verbosity(before)
