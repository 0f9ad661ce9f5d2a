# Targets of the EAGLE-3 draft-training runner; `make help` lists them.
# Every target first runs scripts/setup.sh, which creates .venv once (and again when
# pyproject.toml or the script changes).
PY := .venv/bin/python
# Prints "<step> took N s" after a step, so that CI's log splits its time by part.
timed = start=$$(date +%s); $(1); status=$$?; echo "== $(2) took $$(( $$(date +%s) - start )) s"; exit $$status

.PHONY: help setup run test test-fast test-slow test-gpu lint fmt wheelhouse

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup:  ## Create .venv with everything the runner needs (first time only)
	bash scripts/setup.sh

run: setup  ## Run the default pipeline: SmolLM2 + ShareGPT on this CPU, no network (20 to 45 min cold on 2 cores)
	$(PY) -m runner

lint: setup  ## Lint and check formatting (ruff, configured in pyproject.toml)
	@$(call timed,$(PY) -m ruff check . && $(PY) -m ruff format --check .,lint)

fmt: setup  ## Format the code and apply ruff's safe fixes
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

# Two workers (pytest-xdist), a test file each at a time: module fixtures are built once. Files
# are handed out longest first (tests/conftest.py, LONGEST_FIRST), not by their test count.
# A worker that dies (the OOM killer) is not replaced: xdist's replacement once waited forever and
# held CI to its limit; the dead worker's test fails and the lane ends.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0
# Each worker on a core of its own, with everything it starts (tests/conftest.py,
# pytest_configure). Unpinned, two vLLM CPU servers bound their threads to the same core and two
# trainings oversubscribed both: on a 2-core x86_64 machine on 2026-12-06 the slow lanes took
# 1,222 s pinned against 2,362 to 2,768 s unpinned, and the fast lane 467 s against 600 s.
PIN := EAGLE3_TEST_PIN_WORKERS=1
test-fast: setup  ## Fast tests: tiny models built in the test, configs, plans, a tiny sweep (8-18 min)
	@$(call timed,$(PIN) $(PY) -m pytest -q $(XDIST) --timeout=600 --durations=15 -m "not e2e and not vllm and not faults",fast tests)

# --durations prints the slowest tests in CI's log, where the next cut would start.
test-slow: setup  ## Slow lanes: end to end on the reduced default, the vLLM lane, fault injection (20-50 min)
	@$(call timed,$(PIN) $(PY) -m pytest -q $(XDIST) --durations=25 -m "e2e or vllm or faults",slow lanes)

test: setup lint test-fast test-slow  ## Everything CI runs: lint, fast tests, then the slow lanes

test-gpu:  ## The GPU lane (tests marked gpu) on a CUDA machine set up by make setup (docs/install.md)
	@$(call timed,$(PY) -m pytest -q -s -m gpu,gpu lane)

# A GPU machine without network: the tested GPU set (vLLM's CUDA build, constraints/) and the
# project as wheels for Python 3.12 on x86_64, installed there with
# `python3 scripts/wheelhouse.py install .whl` (docs/install.md).
wheelhouse: setup  ## Wheels of the tested GPU set for a machine without network: .whl/ (docs/install.md)
	$(PY) scripts/wheelhouse.py build .whl --python-version 3.12 --extra gpu \
	  --constraints constraints/h200-py312-cu130.txt
