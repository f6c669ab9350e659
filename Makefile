# fp4moe: `make help` lists the targets. CPU work runs in a local .venv; GPU targets use the
# GPU machine's system python3 (no venv, no internet there: torch, triton, pytest, hypothesis and
# ml_dtypes come preinstalled), with the two source roots on PYTHONPATH.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
GPU_PYTHON ?= python3
# make test's pytest-xdist workers (the suite: ~16 min on 2 cores with 2, ~22 min with 1)
TEST_WORKERS ?= 2
BENCH_ARGS ?=
BENCH_OUT ?= results/kernels
LAYER_OUT ?= results/moe_layer
LAYER_GPUS ?= 1
LAYER_ARGS ?=
REPORT_ARGS ?=
SLURM ?=
UI_HOST ?= 127.0.0.1
UI_PORT ?= 5000
JUPYTER_PORT ?= 8888
STAMP := $(VENV)/.installed
# The project's MLflow store, by fp4moe.tracking.mlflow_store.tracking_uri()'s rule: $MLFLOW_TRACKING_URI, else the
# sqlite file mlruns/mlflow.db under $FP4MOE_HOME or this folder (the repository root).
STORE_URI := $(or $(MLFLOW_TRACKING_URI),sqlite:///$(abspath $(or $(FP4MOE_HOME),$(CURDIR)))/mlruns/mlflow.db)

.DEFAULT_GOAL := help
.PHONY: help venv test test-gpu bench-kernels bench-layer log-bench reproduce-table report mlflow-ui notebooks clean

help: ## show this list
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

venv: $(STAMP) ## create/update .venv (pip install -e '.[test]'; reruns only when pyproject.toml changes)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

test: venv ## run the CPU test suite in $(TEST_WORKERS) processes, one file each at a time (GPU tests skip themselves)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Every file with a test marked gpu lies under one of these (tests/test_gpu_test_list.py checks it; the device
# runbook's `tests` phase, tools/device/h200_p3.sh, reads this line too)
GPU_TESTS = tests/kernels tests/ops tests/moe tests/bench/test_moe_layer.py tests/train/test_train_gpu.py tests/train/test_memtrace.py

test-gpu: ## run the GPU tests with the system python3 (GPU machine)
	PYTHONPATH=src:kernels $(GPU_PYTHON) -m pytest -q -m gpu $(GPU_TESTS)

# The benchmark writes $(BENCH_OUT)/kernels_<gpu>_<date>_<commit>.{json,csv,md}; set BENCH_OUT, not --out, to
# move it. Then its JSON is logged to MLflow with the first python that imports mlflow (the venv's,
# else $(GPU_PYTHON)); the GPU image has none, so the command to run elsewhere is printed instead.
# Logging is idempotent: earlier files in $(BENCH_OUT) that are already logged add nothing.
bench-kernels: ## run the kernel benchmark on the GPU, then log it to MLflow (args: BENCH_ARGS="...")
	PYTHONPATH=src:kernels $(GPU_PYTHON) -m fp4moe_kernels.bench.conversions --out $(BENCH_OUT) $(BENCH_ARGS)
	@files="$$(ls $(BENCH_OUT)/kernels_*.json 2>/dev/null)"; \
	if [ -z "$$files" ]; then echo "no $(BENCH_OUT)/kernels_*.json to log"; exit 1; fi; \
	for py in $(VENV)/bin/python $(GPU_PYTHON); do \
	  if PYTHONPATH=src $$py -c 'import mlflow' >/dev/null 2>&1; then \
	    echo "PYTHONPATH=src $$py -m fp4moe.tracking.bench_log" $$files; \
	    PYTHONPATH=src $$py -m fp4moe.tracking.bench_log $$files; exit $$?; \
	  fi; \
	done; \
	echo "mlflow is not importable here, so the results were NOT logged to MLflow."; \
	echo "Copy $(BENCH_OUT)/ to a machine with the venv and run there, in the repository root:"; \
	echo "  make log-bench    # = $(VENV)/bin/python -m fp4moe.tracking.bench_log" $$files

# The MoE layer benchmark (P2): bf16 / fp8 / mxfp4 side by side; LAYER_GPUS=2 runs EP=2 with torchrun.
bench-layer: ## run the MoE layer benchmark on 1 GPU (LAYER_GPUS=2: EP=2), results in $(LAYER_OUT)
ifeq ($(LAYER_GPUS),1)
	PYTHONPATH=src:kernels $(GPU_PYTHON) -m fp4moe.bench.moe_layer --out $(LAYER_OUT) $(LAYER_ARGS)
else
	PYTHONPATH=src:kernels $(GPU_PYTHON) -m torch.distributed.run --nproc-per-node $(LAYER_GPUS) -m fp4moe.bench.moe_layer --out $(LAYER_OUT) --no-gemm $(LAYER_ARGS)
endif

log-bench: venv ## log every results/kernels/kernels_*.json (BENCH_OUT) to MLflow with the venv (idempotent)
	@files="$$(ls $(BENCH_OUT)/kernels_*.json 2>/dev/null)"; \
	if [ -z "$$files" ]; then echo "no $(BENCH_OUT)/kernels_*.json to log (make bench-kernels on a GPU writes them)"; exit 1; fi; \
	echo "$(VENV)/bin/python -m fp4moe.tracking.bench_log" $$files; \
	$(VENV)/bin/python -m fp4moe.tracking.bench_log $$files

reproduce-table: venv ## run what exists of the reproduction and list what does not yet (SLURM=<profile>: as Slurm jobs)
	$(VENV)/bin/python -m fp4moe.reproduce $(if $(SLURM),--slurm $(SLURM))

report: venv ## write results/report/ (Markdown, CSV, PNG) from MLflow and conf/paper/numbers.yaml (args: REPORT_ARGS)
	$(VENV)/bin/python -m fp4moe.report $(REPORT_ARGS)

# Optional extras, installed into .venv on first use (pyproject.toml): 'ui' is the full mlflow (its server; the
# project itself needs only mlflow-skinny), 'notebooks' is JupyterLab. --no-compile: pip would byte-compile all of
# scipy, scikit-learn and pyarrow that full mlflow brings (80 s of a 2-core machine's time instead of 25 s); the few
# modules the server imports are compiled when it first imports them.
$(VENV)/.installed-%: $(STAMP)
	$(VENV)/bin/python -m pip install -q --no-compile -e '.[$*]'
	touch $@

# A store that is already a server (MLFLOW_TRACKING_URI=http...) is its own UI: nothing to start.
ifneq ($(filter http://% https://%,$(STORE_URI)),)
mlflow-ui: ## open the MLflow UI on the project's store (MLFLOW_TRACKING_URI, else mlruns/; UI_PORT)
	@echo "the store $(STORE_URI) is an MLflow server: its UI is that address (open it in a browser)"
else
# One worker and no job runner: mlflow's defaults (four uvicorn workers under uvicorn's supervisor, and a huey job runner
# with seven consumer processes for its GenAI jobs) never served on a 2-core machine: a worker still importing mlflow
# misses the supervisor's 5 s health check and is killed and started again, in a loop ("Child process [N] died").
mlflow-ui: $(VENV)/.installed-ui
	$(if $(filter sqlite:///%,$(STORE_URI)),mkdir -p '$(dir $(patsubst sqlite:///%,%,$(STORE_URI)))')
	@echo "MLflow UI of $(STORE_URI) at http://$(UI_HOST):$(UI_PORT) (Ctrl-C stops it)"
	MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri '$(STORE_URI)' --host $(UI_HOST) --port $(UI_PORT) --workers 1
endif

# As root (containers, CI, the project's own machines) JupyterLab refuses to start without --allow-root.
notebooks: $(VENV)/.installed-notebooks ## open JupyterLab on notebooks/ (they read MLFLOW_TRACKING_URI, else mlruns/)
	@echo "the notebooks read $(STORE_URI) (their parameters cell's tracking_uri overrides it)"
	MLFLOW_TRACKING_URI='$(STORE_URI)' $(VENV)/bin/jupyter lab --ServerApp.root_dir=notebooks --ServerApp.ip=$(UI_HOST) --ServerApp.port=$(JUPYTER_PORT)$(if $(filter 0,$(shell id -u)), --allow-root)

clean: ## remove .venv, build outputs and caches (keeps mlruns/ and results/)
	rm -rf $(VENV) .venv-mlflow-server .venv-mlflow-server.lock build .pytest_cache .hypothesis .import_linter_cache
	find . -path ./.git -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
