PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck docs bench gpu-check tutorials clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.14.1 torchvision==0.29.1 || $(BIN)/pip install --quiet "torch>=2.4" "torchvision>=0.19"
	$(BIN)/pip install --quiet -e ".[examples,dev]"
	$(BIN)/pip install --quiet -e ".[transformers]" || echo "transformers not installed: the Hugging Face tests will skip"
	$(BIN)/pip install --quiet -e ".[timm]" || echo "timm not installed: the timm model-hub tests will skip"
	$(BIN)/pip install --quiet -e ".[fast]" || echo "numba not installed: stochastic rounding runs as PyTorch operations"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python examples/mnist/train.py

# two pytest workers (pytest-xdist, from the dev extra) on the 2-core CI machine; the
# slowest 25 tests are listed at the end (the suite must stay under 12 minutes); workers
# steal queued tests from each other, so that a long test late in one queue does not
# leave the other worker idle
test: $(STAMP) lint typecheck docs
	$(BIN)/python -m pytest -q --durations=25 $$($(BIN)/python -c "import xdist" 2>/dev/null && echo "-n 2 --dist worksteal")

# ruff, configured in pyproject.toml ([tool.ruff]); `make test` runs it first
lint: $(STAMP)
	$(BIN)/python -m ruff check poptorchsim benchmarks tests tools examples

# mypy over the IR, the passes, the estimate and the engine ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(BIN)/python -m mypy

# the documentation site (mkdocs.yml) into site/, strict: a broken link within docs/ or
# a page missing from the nav fails; `make test` builds it after the lint
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python benchmarks/mnist_training.py
	$(BIN)/python benchmarks/fidelity.py
	$(BIN)/python benchmarks/tile_scaling.py
	$(BIN)/python benchmarks/model_zoo.py
	$(BIN)/python benchmarks/model_hub.py --markdown benchmarks/out/model_hub.md
	$(BIN)/python benchmarks/compile_passes.py
	$(BIN)/python benchmarks/host_speed.py
	$(BIN)/python benchmarks/planner.py --json benchmarks/out/planner.json
	$(BIN)/python benchmarks/meta_compile.py

# the CUDA host device's check (issue 33): parity, speed against eager CUDA, and with
# EXAMPLES=/path/to/graphcore/examples Graphcore's BERT demo_tiny_128 and ViT
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(if $(EXAMPLES),--examples $(EXAMPLES))

clean:
	rm -rf $(VENV) build *.egg-info site
