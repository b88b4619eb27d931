# Two commands do everything on a fresh machine (see README):
#   make replay   install, then run the replay (ARGS='--config.definitions=...' to narrow it)
#   make test     install, then run the whole test suite
#   make aot      install the optional aot extra, then compile every kernel for sm_90a (ARGS='--definition=...')
# The interpreter is `python` as resolved by pyenv through .python-version (3.12).

PYTHON ?= python
VENV := .venv
STAMP := $(VENV)/.installed-stamp

$(STAMP): setup.py constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jaxkern needs Python >= 3.12 (see .python-version), got " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

AOT_STAMP := $(VENV)/.aot-stamp

$(AOT_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,aot]'
	touch $(AOT_STAMP)

.PHONY: install replay test aot test-aot
install: $(STAMP)

replay: $(STAMP)
	$(VENV)/bin/python -m jaxkern.replay --config configs/replay.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --durations=15 tests

aot: $(AOT_STAMP)
	$(VENV)/bin/python -m jaxkern.aot $(ARGS)

test-aot: $(AOT_STAMP)
	$(VENV)/bin/python -m pytest -q -n 0 tests/test_aot.py
