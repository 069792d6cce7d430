# ddp-no-sync-lab. The two commands: `make lab` runs the experiment, `make test` runs the tests.
# Others: `make quick` (the whole pipeline on small synthetic data, no network), `make check` (what this
# machine has and which way the lab will run), `make clean` (removes the lab's outputs and .venv).
# DATA=path uses another dataset folder (image folders or torchvision's CIFAR-10), e.g. an offline copy.

LAB_DIR := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TRAIN := $(VENV)/bin/torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py
DATA ?= data
ARTIFACTS ?= artifacts
QUICK_DATA := data/synthetic
QUICK := artifacts/quick

.PHONY: lab quick test check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.requirements: requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.requirements-dev: requirements-dev.txt requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The documented experiment: both modes, 5 epochs, local batch 50, accum_steps 4; on two GPUs when there
# are two, else on CPU (train.py's device policy). Then the audit and one inference.
lab: $(VENV)/.requirements
	$(TRAIN) --mode every --output $(ARTIFACTS)/every --data-dir $(DATA)
	$(TRAIN) --mode no_sync --output $(ARTIFACTS)/no_sync --data-dir $(DATA)
	$(PY) verify.py --artifacts $(ARTIFACTS)
	$(PY) infer.py --checkpoint $(ARTIFACTS)/no_sync/model.pt --image $(ARTIFACTS)/no_sync/sample_test.png

# The same pipeline in about a minute: 2,000 + 500 synthetic images, 3 epochs, audited against its own
# configuration.
quick: $(VENV)/.requirements
	test -d $(QUICK_DATA) || $(PY) synthetic_data.py --out $(QUICK_DATA) --train-source 2000 --test 500
	$(TRAIN) --mode every --output $(QUICK)/every --data-dir $(QUICK_DATA) --epochs 3
	$(TRAIN) --mode no_sync --output $(QUICK)/no_sync --data-dir $(QUICK_DATA) --epochs 3
	$(PY) verify.py --artifacts $(QUICK) --expect-from-config
	$(PY) infer.py --checkpoint $(QUICK)/no_sync/model.pt --image $(QUICK)/no_sync/sample_test.png

test: $(VENV)/.requirements-dev
	$(PY) -m pytest -q tests

check: $(VENV)/.requirements
	$(PY) check_env.py

# Only the lab's own outputs, in the lab's own folder (as the document's clean-up does).
clean:
	cd "$(LAB_DIR)" && test -f train.py && test -f model.py && \
	rm -rf artifacts data .venv __pycache__ tests/__pycache__ .pytest_cache
