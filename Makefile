# kvfabric developer tasks. `make help` lists them.
SHELL := /bin/bash
UV := uv run --frozen
PYTEST_ARGS ?=

##@ Main

.PHONY: demo
demo: bootstrap-demo ## Run the whole fabric on the local cluster with its defaults
	$(UV) kvfabric demo

.PHONY: test
test: bootstrap lint ## Install what is needed, lint, and run every test (every level of the ladder, kind included)
	KVFABRIC_KIND=$${KVFABRIC_KIND:-1} $(UV) pytest tests e2e $(PYTEST_ARGS)

##@ Pieces

# One target per level of the test ladder (markers assigned by kvfabric.testing.levels).
.PHONY: test-unit test-process test-images test-cluster test-fabric test-kubelet test-vllm test-kind
test-unit: ## Only the unit tests (pure functions, in-process objects): well under a minute
	$(UV) pytest tests -m unit -q $(PYTEST_ARGS)
test-process: ## Only the tests that run real cache-server and engine processes
	$(UV) pytest tests -m process $(PYTEST_ARGS)
test-images: bootstrap ## Only the built images, each run in a container
	$(UV) pytest tests -m images $(PYTEST_ARGS)
test-cluster: bootstrap ## Only the tests against the real local control plane
	$(UV) pytest tests -m cluster $(PYTEST_ARGS)
test-fabric: bootstrap ## Only the whole-fabric end-to-end tests
	$(UV) pytest e2e -m fabric $(PYTEST_ARGS)
test-kubelet: bootstrap ## Only the tests on real kubelets (the built images as deployed)
	$(UV) pytest e2e -m kubelet $(PYTEST_ARGS)
test-vllm: bootstrap ## Only the tests inside real vLLM (CPU; the bootstrap builds its pinned env), in the fabric too
	$(UV) pytest tests e2e -m vllm $(PYTEST_ARGS)
test-kind: bootstrap ## Only the kind cluster from the offline node image (built first: KVFABRIC_KIND=1)
	KVFABRIC_KIND=$${KVFABRIC_KIND:-1} $(UV) pytest e2e -m kind $(PYTEST_ARGS)

.PHONY: bootstrap bootstrap-demo
bootstrap-demo: ## Install only what the demo and the local cluster need (.venv, control-plane binaries)
	@scripts/bootstrap.sh --demo
bootstrap: ## Install Debian packages, uv, .venv, the pinned Kubernetes binaries and kubelet, the images (idempotent)
	@scripts/bootstrap.sh

.PHONY: lint
lint: ## ruff, ruff format --check, mypy --strict, import-linter
	$(UV) ruff check .
	$(UV) ruff format --check .
	$(UV) mypy
	$(UV) lint-imports

.PHONY: fmt
fmt: ## Format and autofix
	$(UV) ruff format .
	$(UV) ruff check --fix .

.PHONY: generate
generate: ## Regenerate the CRDs and the protobuf stubs
	$(UV) python -m kvfabric.operator.crdgen
	scripts/gen-proto.sh

.PHONY: cluster-up cluster-down
cluster-up: bootstrap-demo ## Start the local control plane (fake GPU nodes) and leave it running
	$(UV) kvfabric cluster up
cluster-down: ## Stop the local control plane
	$(UV) kvfabric cluster down

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*?##/ { printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)
