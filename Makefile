# pd-operator: every target installs what it needs into .venv first.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
KUBECONFIG_LOCAL := $(CURDIR)/.localcluster/kubeconfig
BIN_DIR = $(shell hack/k8s-bins/build.sh --print-dir)

.PHONY: help venv lint k8s-bins lwepp vllm-ascend-src cluster-up cluster-down test test-unit test-vllm test-integration test-e2e e2e-kind images lint-workflows crd crd-check docs demo bench bench-sim bench-links bench-switch bench-gateway bench-decide bench-rebalance bench-policy-sim soak busy-machine busy-machine-stop clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

$(STAMP): pyproject.toml
	@echo "[venv] creating $(VENV) and installing pd-operator with its test extra"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	@touch $@

venv: $(STAMP) ## create .venv with the project and its test extra

LINT_STAMP := $(VENV)/.lint-stamp
$(LINT_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,lint]'
	@touch $@

# every Python package the images run is type-checked
TYPED := operator/pd_operator gateway/pd_gateway contract/pd_contract router/pd_router engines/pd_engine agent/pd_agent simulator/llm_datadist_sim

lint: $(LINT_STAMP) ## ruff over everything, mypy over the operator, the gateway, the agent and simulator, the contract package and pd_engine
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy $(TYPED)
	@echo "[lint] clean"

BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	@touch $@

k8s-bins: ## build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm (cached)
	@hack/k8s-bins/build.sh

vllm-ascend-src: ## vllm-ascend's source to check the Mooncake config against (its sdist from PyPI, pinned digest, read only; cached)
	@python3 hack/vllm/ascend_src.py >/dev/null

lwepp: ## build GIE's reference endpoint picker (cmd/lwepp), an ext_proc probe and the InferencePool CRD (cached)
	@hack/lwepp/build.sh

cluster-up: venv k8s-bins ## start the local control plane and node agent (idempotent)
	@$(PY) -m pd_localcluster up --bin-dir "$(BIN_DIR)"

cluster-down: venv ## stop the local cluster and remove its state (idempotent)
	@$(PY) -m pd_localcluster down

test: venv k8s-bins lwepp vllm-ascend-src lint-workflows images ## every test: unit, integration on the local cluster, e2e from the images
	$(PY) -m pytest tests -v -p no:cacheprovider

test-unit: venv vllm-ascend-src ## unit tests only (seconds; no control plane)
	$(PY) -m pytest tests/unit -q -p no:cacheprovider

# the oldest and the newest vLLM releases vllm-ascend pairs with (docs/engines.md), each in a venv of its own
VLLM_VERSIONS ?= 0.9.1 0.23.0
VLLM_VENVS ?= $(HOME)/.cache/pd-operator/vllm
test-vllm: venv ## pd_engine against real vLLM releases (VLLM_VERSIONS, each in its own venv from PyPI, about 5 GB each): the engine wheel installs beside them, the connector on vLLM's KVConnectorBase_V1, the protocol fields against vLLM's
	$(PY) hack/engine-wheel/build.py --out dist
	@set -e; for v in $(VLLM_VERSIONS); do \
	  hack/vllm/venv.sh $$v $(VLLM_VENVS)/$$v dist/pd_engine-*.whl; \
	  py=$(VLLM_VENVS)/$$v/bin/python; \
	  (cd / && $$py -c "import pd_engine, pd_engine.vllm_connector as v; assert v.VLLM, 'vllm did not import'; \
	    assert 'site-packages' in pd_engine.__file__; print('[test-vllm] connector on vLLM', v.KVConnectorBase_V1.__module__)" \
	    && $$py $(CURDIR)/hack/vllm/check_protocol.py); \
	  PYTHONPATH=$(CURDIR) $$py -m pytest tests/unit/test_vllm_connector.py tests/unit/test_vllm_standin.py -q \
	    -p no:cacheprovider -W ignore; \
	done

test-integration: venv k8s-bins lwepp ## integration tests only
	$(PY) -m pytest tests/integration -v

test-e2e: venv k8s-bins images ## e2e scenarios on a local cluster whose pods run from their images (Docker)
	$(PY) -m pytest tests/e2e -v -p no:cacheprovider

e2e-kind: venv k8s-bins images ## the e2e scenarios on a kind cluster (needs a registry for kind's node image)
	@PY="$(PY)" hack/e2e/kind.sh

images: venv ## build pd-operator, pd-sim-agent, pd-gateway with Docker (installs and starts Docker if missing)
	@PY="$(PY)" hack/images/build.sh

lint-workflows: ## actionlint the GitHub Actions workflows (built from its Go module, cached)
	@"$$(hack/tools/build.sh actionlint)" -color .github/workflows/*.yaml && echo "[actionlint] workflows ok"

crd: venv ## regenerate the CRD (crds/ and the chart's copy) from the pydantic models
	$(PY) -m pd_operator.crdgen --out crds/pddeployment.yaml --out charts/pd-operator/crds/pddeployment.yaml
	$(PY) -m pd_operator.crdgen --kind PDGateway --out crds/pdgateway.yaml --out charts/pd-operator/crds/pdgateway.yaml

crd-check: venv ## fail if a CRD (crds/ or the chart's copy) differs from what the pydantic models generate
	$(PY) -m pd_operator.crdgen --check crds/pddeployment.yaml
	$(PY) -m pd_operator.crdgen --check charts/pd-operator/crds/pddeployment.yaml
	$(PY) -m pd_operator.crdgen --kind PDGateway --check crds/pdgateway.yaml
	$(PY) -m pd_operator.crdgen --kind PDGateway --check charts/pd-operator/crds/pdgateway.yaml

docs: venv ## regenerate docs/reference/ (custom resources, chart values, kubectl pdd, environment) from the code
	$(PY) hack/docs/gen.py

demo: cluster-up ## the main job: operator (Helm chart) + examples/sim-small.yaml on the local cluster
	@BIN_DIR="$(BIN_DIR)" PY="$(PY)" hack/demo.sh

bench-sim: venv ## KV pull throughput over loopback and agent API latency
	$(PY) bench/bench_sim.py

bench-links: venv k8s-bins ## pods Ready -> links up + KV path verified (2P2D .. 64P64D, and 4P4D at TP 8), idle agent calls and CPU
	$(PY) bench/bench_links.py

.PHONY: bench-scale
bench-scale: venv k8s-bins ## 100 PDDeployments x (4P+4D) x TP 8 on fake agents and a fake Node, on a cluster of its own: pass latency, operator CPU and RSS, idle calls/s, takeover, status sizes (ARGS="--deployments 20 --prefill 1 --decoder 1 --tp 2": smaller)
	$(PY) bench/bench_scale.py $(ARGS)

bench-switch: venv k8s-bins ## one live role switch per direction under load (one engine, an instance of 8 ranks, one of 16 ranks over 2 pods, then vllm-ascend's Mooncake connector: a drained restart): control-plane cost and drain time
	$(PY) bench/bench_switch.py && $(PY) bench/bench_switch.py --tp 8 --switches 3 --rate 2 \
	  && $(PY) bench/bench_switch.py --tp 16 --pods-per-instance 2 --switches 3 --rate 2 \
	  && $(PY) bench/bench_switch.py --kv-transfer mooncake --switches 3 --rate 3 --max-output 16

bench-gateway: venv ## latency pd-gateway adds per request, and requests/s it routes on one core
	$(PY) bench/bench_gateway.py

bench-decide: venv ## decide's settled pass at 64P+64D TP 8 (no cluster; goal: median <= 20 ms) and the status size with every link failing (ARGS="--prefill 8 --decoder 8 --tp 2 --passes 20": other sizes)
	PYTHONPATH=$(CURDIR):$(CURDIR)/operator:$(CURDIR)/agent:$(CURDIR)/simulator:$(CURDIR)/contract:$(CURDIR)/router:$(CURDIR)/engines:$(CURDIR)/gateway:$(CURDIR)/localcluster \
		$(PY) bench/bench_decide.py $(ARGS)

bench-rebalance: $(BENCH_STAMP) k8s-bins ## live switching vs fixed ratios vs Replace on three traces (about 30 min; QUICK=1: a subset; ENGINES=16: trace b at 16 engines, one fleet at a time, about 35 min; WORKLOAD=steps:101 [RUNS=goodput]: one generated workload beside the model's prediction, about 10 min a run)
ifneq ($(WORKLOAD),)
	$(PY) bench/bench_rebalance.py --engines $(or $(ENGINES),16) --workload $(WORKLOAD) --runs $(or $(RUNS),goodput) \
		--one-at-a-time
else ifeq ($(or $(ENGINES),4),4)
	$(PY) bench/bench_rebalance.py $(if $(QUICK),--quick,) && \
	$(PY) bench/bench_policy_sim.py --sizes 4 --workloads "" --no-plot --out bench/results/policy-sim-4.json \
		--compare bench/results/rebalance.json
else
	$(PY) bench/bench_rebalance.py --engines $(ENGINES) --traces shift --runs best-fixed,Goodput,Load+Replace \
		--one-at-a-time && \
	$(PY) bench/bench_policy_sim.py --sizes $(ENGINES) --traces shift --workloads "" --routers $$(( $(ENGINES) / 4 )) \
		--no-plot --out bench/results/policy-sim-$(ENGINES).json --compare bench/results/rebalance-$(ENGINES).json
endif

bench-policy-sim: $(BENCH_STAMP) ## the policies and a grid of fixed ratios on a discrete-event model of 4, 32 and 256 engines (over an hour)
	$(PY) bench/bench_policy_sim.py $(if $(wildcard bench/results/rebalance.json),--compare bench/results/rebalance.json,)

soak: venv k8s-bins ## pods, containers and operators killed, switches and scaling, malformed requests, under load (30 min; MINUTES=5: shorter)
	$(PY) bench/soak.py --minutes $(or $(MINUTES),30)

bench: bench-sim bench-links bench-switch bench-gateway ## every benchmark

busy-machine: venv k8s-bins ## load the machine as the suite must survive: a second local cluster running sim-small under traffic, and stress-ng on both cores
	@BIN_DIR="$(BIN_DIR)" PY="$(PY)" hack/busy-machine.sh start

busy-machine-stop: venv ## stop what busy-machine started
	@BIN_DIR="$(BIN_DIR)" PY="$(PY)" hack/busy-machine.sh stop

clean: cluster-down ## remove .venv
	rm -rf $(VENV)
