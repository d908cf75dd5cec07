# The two commands of the README: `make run` (set up + main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?= --ep 8

.PHONY: venv run test clean gpu-deps

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 || $(BIN)/python -m pip install -q "torch>=2.6,<2.14"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/python -m epmoe.launch $(ARGS)

test: venv
	PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q

# DeepEP v1 + DeepGEMM built against the installed torch (CUDA machine; see README "GPU").
# Sources from git by default; offline: GPU_DEPS_ARGS="--src DIR --cutlass-wheel WHL".
GPU_SITE ?= .gpu/site
GPU_DEPS_ARGS ?=
gpu-deps:
	bash tools/build_gpu_deps.sh --target $(GPU_SITE) --check --strip $(GPU_DEPS_ARGS)

clean:
	rm -rf $(VENV)
