# ddp-no-sync-lab. The two commands: `make lab` runs the experiment, `make test` runs the tests.
# Others: `make quick` (the whole pipeline on small synthetic data, no network), `make check` (what this
# machine has and which way the lab will run), `make text` and `make text-quick` (the second task: packed
# sequences of text, per-token loss normalization; docs/packed.md), `make compat TORCH=x.y.z` (make quick and the suite on another
# torch, in its own environment), `make clean` (removes the lab's outputs and environments).
# DATA=path uses another dataset folder (image folders or torchvision's CIFAR-10), e.g. an offline copy.

LAB_DIR := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TRAIN := $(VENV)/bin/torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py
DATA ?= data
ARTIFACTS ?= artifacts
QUICK_DATA := data/quick
QUICK := artifacts/quick
TEXT := artifacts/text
TEXT_QUICK := artifacts/text-quick

.PHONY: lab quick text text-quick test test-fast lint check compat compat-run install-package clean

# A venv that failed half-way (no ensurepip: python3-venv missing) is removed, so that the next try starts clean.
$(PY):
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

# The lab's package (pyproject.toml), editable in setuptools' compat mode: the checkout's root on the
# environment's path, so that tools/, benchmarks/ and tests/ import it, model.py and train.py from any folder
# (--config-settings needs pip 22.1: Ubuntu 22.04's venv has 22.0).
define install_package
	$(PY) -m pip install --quiet "pip>=22.1"
	$(PY) -m pip install --no-deps --editable . --config-settings editable_mode=compat
endef

# pip's progress shown, not silenced: the first install downloads torch's CUDA build, 6.6 GB installed. pip would
# compile the installed modules' bytecode on one core; compileall does it on every core (26 s against 14 s on two
# for the dev requirements), or on one where it cannot start its workers; a file it cannot compile is said and
# left to Python, as pip leaves it.
define install_requirements
	$(PY) -m pip install --no-compile -r $(1)
	-$(PY) -m compileall -q -j 0 $(VENV)/lib || $(PY) -m compileall -q $(VENV)/lib
endef

$(VENV)/.requirements: requirements.txt pyproject.toml | $(PY)
	$(call install_requirements,requirements.txt)
	$(install_package)
	touch $@

# requirements-dev.txt holds requirements.txt: one install makes both (CI's lint, check and tests in one pip run).
$(VENV)/.requirements-dev: requirements-dev.txt requirements.txt pyproject.toml | $(PY)
	$(call install_requirements,requirements-dev.txt)
	$(install_package)
	touch $(VENV)/.requirements $@

# The documented experiment: both modes, 5 epochs, local batch 50, accum_steps 4; on two GPUs when there
# are two, else on CPU (train.py's device policy). Then the audit and one inference.
lab: $(VENV)/.requirements
	$(TRAIN) --mode every --output $(ARTIFACTS)/every --data-dir $(DATA)
	$(TRAIN) --mode no_sync --output $(ARTIFACTS)/no_sync --data-dir $(DATA)
	$(PY) verify.py --artifacts $(ARTIFACTS)
	$(PY) infer.py --checkpoint $(ARTIFACTS)/no_sync/model.pt --image $(ARTIFACTS)/no_sync/sample_test.png

# The same pipeline in about a minute: 1,000 + 500 synthetic images (400 per rank: 2 windows per epoch), 3
# epochs, audited against its own configuration; within 90 s on 2 cores without BF16 instructions.
define quick_pipeline
	test -d $(QUICK_DATA) || $(PY) tools/synthetic_data.py --out $(QUICK_DATA) --train-source 1000 --test 500
	$(TRAIN) --mode every --output $(QUICK)/every --data-dir $(QUICK_DATA) --epochs 3
	$(TRAIN) --mode no_sync --output $(QUICK)/no_sync --data-dir $(QUICK_DATA) --epochs 3
	$(PY) verify.py --artifacts $(QUICK) --expect-from-config
	$(PY) infer.py --checkpoint $(QUICK)/no_sync/model.pt --image $(QUICK)/no_sync/sample_test.png
endef

quick: $(VENV)/.requirements
	$(quick_pipeline)

# The second task (docs/packed.md): a byte-level transformer on Python's own documentation texts, packed into
# rows; its documented configuration, audited strictly. text-quick: one epoch, audited by its own configuration.
text: $(VENV)/.requirements
	$(TRAIN) --task text --mode every --output $(TEXT)/every
	$(TRAIN) --task text --mode no_sync --output $(TEXT)/no_sync
	$(PY) verify.py --artifacts $(TEXT)

text-quick: $(VENV)/.requirements
	$(TRAIN) --task text --mode every --output $(TEXT_QUICK)/every --epochs 1
	$(TRAIN) --task text --mode no_sync --output $(TEXT_QUICK)/no_sync --epochs 1
	$(PY) verify.py --artifacts $(TEXT_QUICK) --expect-from-config

# The 15 slowest tests are listed at the end of every run, so that a slow one shows itself. Two test files run
# at a time (pytest-xdist, each file whole in one worker, its fixtures with it): one file's launchers and waits
# leave the cores to the other's ranks. The files go out longest first (tests/conftest.py's LONGEST_FIRST).
PYTEST := -m pytest -q --strict-markers --durations=15 -n 2 --dist loadfile --no-loadscope-reorder
# The checkout's own bytecode, made once: the suite starts about 250 Python processes, each importing the lab,
# and where PYTHONDONTWRITEBYTECODE is set Python would compile its modules again in every one of them.
COMPILE := -m compileall -q ddp_no_sync_lab tests tools benchmarks model.py train.py verify.py infer.py check_env.py

test: $(VENV)/.requirements-dev
	$(PY) $(COMPILE)
	$(PY) $(PYTEST) tests

# The inner loop: the tests that start no torchrun job of their own (they may read the shared pair, one start
# per test worker), within 2 minutes; `make test` runs these and the rest (docs/tests.md).
test-fast: $(VENV)/.requirements-dev
	$(PY) $(COMPILE)
	$(PY) $(PYTEST) -m "not torchrun" tests

# The style: ruff's formatter and linter (ruff.toml), checked, never rewritten here (`ruff format .` does).
lint: $(VENV)/.requirements-dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

check: $(VENV)/.requirements
	$(PY) check_env.py

# Another torch in its own environment (.venv-torch-X.Y.Z; pip picks the torchvision made for it): make quick
# and the suite there. Not part of CI (it installs a second torch); its results are in docs/speed.md.
compat:
	@test -n "$(TORCH)" || { echo "make compat: name the version, e.g. make compat TORCH=2.11.0" >&2; exit 2; }
	test -x .venv-torch-$(TORCH)/bin/python || $(PYTHON) -m venv .venv-torch-$(TORCH)
	.venv-torch-$(TORCH)/bin/python -m pip install --quiet "torch==$(TORCH)" torchvision \
		$$(grep -h -E '^(pillow|pytest|pytest-xdist|execnet|accelerate|lightning|transformers)==' requirements.txt requirements-dev.txt)
	$(MAKE) --no-print-directory install-package VENV=.venv-torch-$(TORCH)
	$(MAKE) --no-print-directory compat-run VENV=.venv-torch-$(TORCH) QUICK=artifacts/quick-torch-$(TORCH)

install-package:
	$(install_package)

compat-run:
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
	$(quick_pipeline)
	$(PY) $(PYTEST) tests

# Only the lab's own outputs, in the lab's own folder (as the document's clean-up does).
clean:
	cd "$(LAB_DIR)" && test -f train.py && test -f model.py && \
	rm -rf artifacts data .venv .venv-torch-* ddp_no_sync_lab.egg-info __pycache__ .pytest_cache && \
	find ddp_no_sync_lab tests tools benchmarks -name __pycache__ -prune -exec rm -rf {} +
