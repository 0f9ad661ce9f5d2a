# make run: set up .venv (first time only) and run the default pipeline.
# make test: set up .venv and run the test suite (fast tests + the end-to-end and vLLM parity lanes).
.PHONY: setup run test test-fast
setup:
	bash scripts/setup.sh
run: setup
	.venv/bin/python -m runner
test: setup
	.venv/bin/python -m pytest -q
test-fast: setup
	.venv/bin/python -m pytest -q -m "not e2e and not vllm"
