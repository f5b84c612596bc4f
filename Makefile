# One command from a fresh clone: `make test` builds .venv (CPU torch, deepspeed from source) and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Test processes side by side (pytest-xdist), one test file each at a time (module fixtures such as a trained run
# are built once). 3 on the 2-core machines CI runs on: much of a launched test is one process waiting (a launcher,
# a rendezvous, a Slurm requeue); with 2 the cores sat idle 9% of the suite, with 3 1%. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
# The suite starts ~1,300 Python processes: each reads the project's compiled modules (and pytest's rewritten test
# modules) from __pycache__ instead of compiling them again, even where PYTHONDONTWRITEBYTECODE is set (as on the
# machines here).
TEST_ENV := PYTHONDONTWRITEBYTECODE=

.PHONY: venv demo test test-fast lint bench clean

$(VENV)/.installed: setup.cfg pyproject.toml tools/system_packages.sh
	# Each step runs only when what it installs is missing, so an environment built by hand (README "Install") is
	# reused, not rebuilt; pip itself skips requirements that are already satisfied.
	# Debian packages (venv, compiler, Open MPI), each only when missing: as root directly, as a user with sudo.
	tools/system_packages.sh
	test -x $(PY) || { $(PYTHON) -m venv $(VENV) && $(PIP) install --upgrade pip wheel setuptools; }
	# torch first: on this CPU machine the pin resolves to the CPU build on disk, on a GPU cluster to CUDA.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==$(TORCH_VERSION)
	# deepspeed builds against the torch above, so it must not get an isolated build environment.
	$(PIP) install --no-build-isolation 'deepspeed>=0.19,<0.20'
	$(PIP) install -e '.[dev,mpi,remote]'
	# timm's pure-PyTorch Lamb is the independent reference the LAMB tests compare against. --no-deps: its
	# torchvision requirement would replace the CPU torch above; the tests load timm/optim/lamb.py alone.
	$(PIP) install --no-deps timm==1.0.31
	# DeepSpeed compiles its CPU shared-memory comm extension on first use: build it now, not in the first job.
	$(PY) -c "from bert_ds.runtime.caches import load_extensions; print('built:', load_extensions())"
	touch $@

venv: $(VENV)/.installed

# README command one: corpus -> tokenizer -> shards -> both phases on 2 CPU ranks -> export -> fill-mask -> plot.
demo: venv
	$(PY) tools/demo.py --out demo_run

# The sbatch/srun tests need a Slurm controller: start the one-node cluster CI uses when this user can (root or
# passwordless sudo, Slurm installed). A failure is tolerated: those tests then skip and the summary says how to run them.
test: venv
	@if command -v slurmctld >/dev/null 2>&1; then \
	  if [ "$$(id -u)" -eq 0 ]; then .ci/start_slurm.sh || echo "make test: .ci/start_slurm.sh failed; the Slurm tests will skip"; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo -n .ci/start_slurm.sh || echo "make test: sudo .ci/start_slurm.sh failed; the Slurm tests will skip"; \
	  fi; \
	fi
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The default tier: no process tree of ranks (tests/helpers/tiers.py), minutes on 2 cores.
test-fast: venv
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not e2e and not slow and not slurm and not gpu" tests

lint: venv
	$(PY) -m ruff check .

# Every performance figure beside its baseline, measured in the same run (docs/benchmarks.md): minutes to an hour on CPU.
bench: venv
	$(VENV)/bin/bert-ds-benchmark

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
