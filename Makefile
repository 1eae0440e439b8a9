# cachewarm: every target works on a fresh machine with Python 3.11+ and Go 1.26.
include hack/versions.env

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN_DIR := $(CURDIR)/.cache/bin/k8s-v$(K8S_VERSION)_etcd-v$(ETCD_VERSION)
export CACHEWARM_TESTBED_BIN := $(BIN_DIR)
# torch in a venv of its own (5 GB: the PyPI wheel needs its CUDA packages even on CPU), for
# the integration tests that run torch's agents against the GCS emulator; with gcsfs, as the
# torch demo image has it (the warmer uploads through it).
TORCH_VENV := $(CURDIR)/.cache/torch-venv-$(TORCH_VERSION)
export CACHEWARM_TORCH_PYTHON := $(TORCH_VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help venv torch-venv bin node-deps images lint-manifests kstatus test test-unit mutants lint lint-imports docs dev-up dev-down demo demo-simulated clean

help: ## List the targets
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' Makefile

$(VENV)/.installed: pyproject.toml testbed/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -e testbed
	touch $@

venv: $(VENV)/.installed ## Create .venv with the project and its test extras

$(TORCH_VENV)/.installed: hack/versions.env
	rm -rf $(TORCH_VENV)
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) gcsfs==$(GCSFS_VERSION)
	touch $@

torch-venv: $(TORCH_VENV)/.installed ## Create .cache/torch-venv-<version> with torch, for the torch agents' integration tests

bin: ## Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl from Go modules (cached)
	hack/build-binaries.sh $(BIN_DIR)

node-deps: ## Install the real node's Debian packages (containerd, runc, CNI plugins, busybox-static) if missing
	hack/node-deps.sh

images: venv node-deps ## Build the operator, warmer and demo training images from our Dockerfiles with buildah (cached by content)
	$(PY) -m cachewarm_testbed.images build --skip-without-root

lint-manifests: bin ## kube-score the rendered manifests (built once from the Go module proxy); fails on an unjustified CRITICAL
	hack/kube-score.sh $(BIN_DIR)/kubectl

kstatus: ## Build hack/kstatus, the GitOps health check of Flux and kpt (sigs.k8s.io/cli-utils), for the suite (cached)
	hack/build-kstatus.sh >/dev/null

test: venv torch-venv bin node-deps images lint-manifests kstatus lint-imports ## Run the whole suite: manifests lint, import contracts, unit, integration, e2e
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv ## Run the unit tests only (no processes)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

mutants: venv bin node-deps images kstatus ## Apply each tests/mutants/*.patch in a throwaway worktree and expect its named tests to fail (MUTANT=path picks one)
	hack/mutants.sh $(MUTANT)

lint: venv ## Type-check the package (mypy strict)
	$(PY) -m mypy

lint-imports: venv ## Check the import contracts of .importlinter (layers one way, agents standalone)
	PYTHONPATH=$(CURDIR)/operator $(VENV)/bin/lint-imports  # this checkout's package, not whichever the venv installed

docs: venv ## Regenerate docs/reference/compilationcache.md, the CRD field reference, from crds/
	$(PY) hack/crd_reference.py crds/cachewarm.dev_compilationcaches.yaml docs/reference/compilationcache.md

dev-up: venv bin ## Start the local control plane, simulated GKE nodes and the GCS emulator in the background (.dev/env)
	$(PY) -m cachewarm_testbed up .dev

dev-down: venv ## Stop what dev-up started
	$(PY) -m cachewarm_testbed down .dev

demo: venv bin node-deps images ## The main job on a real node (Linux, root): install from manifests/, warm a cache, train warm (demo-report.json)
	$(PY) demo/run.py

demo-simulated: venv bin ## The same without root: simulated nodes and the operator as a local process
	$(PY) demo/run.py --simulated

clean: dev-down ## Remove the venv and build caches of this checkout
	rm -rf $(VENV) .cache
