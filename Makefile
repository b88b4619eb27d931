# Two commands do everything on a fresh machine (see README):
#   make replay   install, then run the replay (ARGS='--config.definitions=...' to narrow it)
#   make test     install, then run the whole test suite (the Bazel build and its test subset, then pytest)
#   make aot      install, then compile every kernel for sm_90a (ARGS='--definition=...')
# The interpreter is `python` as resolved by pyenv through .python-version (3.12).

PYTHON ?= python
VENV := .venv
STAMP := $(VENV)/.installed-stamp
# The aot extra (setup.py: the CUDA 13 plugin of jax's version, ptxas, libdevice)
# for jaxkern.aot and its tests; --no-deps: nvidia-cuda-nvcc would also pull a
# CUDA runtime, which a compile-only target does not use.
AOT_PACKAGES := jax-cuda13-plugin jax-cuda13-pjrt nvidia-cuda-nvcc nvidia-nvvm

$(STAMP): setup.py constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxkern needs Python >= 3.12 (see .python-version), got " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,examples]'
	$(VENV)/bin/python -m pip install -q --no-deps -c constraints.txt $(AOT_PACKAGES)
	touch $(STAMP)

.PHONY: install replay test aot test-aot gpu-run gpu-run-dry bazel
install: $(STAMP)

replay: $(STAMP)
	$(VENV)/bin/python -m jaxkern.replay --config configs/replay.py $(ARGS)

# The Bazel check runs first so that pytest's summary closes the output.
test: $(STAMP)
	$(MAKE) --no-print-directory bazel
	$(VENV)/bin/python -m pytest -q -n 2 --durations=15 tests

aot: $(STAMP)
	$(VENV)/bin/python -m jaxkern.aot $(ARGS)

test-aot: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 0 tests/test_aot.py

# The one prepared device run (see scripts/gpu_run.sh); -dry checks it on a CPU.
gpu-run: $(STAMP)
	PYTHON=$(VENV)/bin/python scripts/gpu_run.sh $(OUT)

gpu-run-dry: $(STAMP)
	DRY_RUN=1 PYTHON=$(VENV)/bin/python scripts/gpu_run.sh $(or $(OUT),results/gpu_run_dry)

# Bazel (Debian's bazel-bootstrap 4.2, installed with apt if missing) builds
# every target and runs a fast test subset offline, on the .venv interpreter.
BAZEL_FLAGS := --override_repository=rules_cc=$(CURDIR)/tools/bazel/stubs/rules_cc \
	--override_repository=rules_java=$(CURDIR)/tools/bazel/stubs/rules_java \
	--override_repository=remote_coverage_tools=$(CURDIR)/tools/bazel/stubs/remote_coverage_tools
BAZEL_TESTS ?= //:test_build //:test_compare //:test_dataset

bazel: $(STAMP)
	command -v bazel >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap)
	bazel --batch build $(BAZEL_FLAGS) //...
	bazel --batch test $(BAZEL_FLAGS) $(BAZEL_TESTS)
