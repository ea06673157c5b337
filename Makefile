# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install demo test test-real-comfyui test-ui lint down clean

# A real ComfyUI 0.8.0 (CPU only, no models) for `make test-real-comfyui`: REAL_COMFYUI names a
# `real-comfyui` installer kept outside the repository (docs/testing.md); the first install
# brings torch (several GB, a few minutes).
# Beside the checkout by default, where the team and CI keep it; empty when it is not there.
REAL_COMFYUI     ?= $(wildcard ../shared/comfyui/real-comfyui)
REAL_COMFYUI_DIR ?= .cache/real-comfyui

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[stack,dev,gateway]'
	rm -f $(VENV)/.installed-* && touch $@

# The RunPod handler's venv (endpoint/requirements.txt): `runpod` cannot share the app's venv.
EP_VENV  := .venv-endpoint
EP_STAMP := $(EP_VENV)/.installed-$(shell cat endpoint/requirements.txt | cksum | cut -d' ' -f1)

$(EP_STAMP): endpoint/requirements.txt
	$(PYTHON) -m venv $(EP_VENV)
	$(EP_VENV)/bin/pip install --quiet --disable-pip-version-check -r endpoint/requirements.txt
	rm -f $(EP_VENV)/.installed-* && touch $@

# The stock runpod-workers/worker-comfyui handler (a test fixture, AGPL-3.0, outside the
# repository: STOCK_WORKER_COMFYUI=path/to/worker-comfyui) gets a venv of its own from its
# requirements (runpod~=1.7.12), for tests/stack/test_runpod_stock.py; without the folder there is
# nothing to build and those tests skip (docs/testing.md).
# Beside the checkout by default (as for REAL_COMFYUI), so CI runs the stock-handler tests.
export STOCK_WORKER_COMFYUI ?= $(wildcard ../shared/worker-comfyui)
STOCK_VENV  := .venv-stock
STOCK_REQS  := $(if $(STOCK_WORKER_COMFYUI),$(wildcard $(STOCK_WORKER_COMFYUI)/requirements.txt))
STOCK_STAMP := $(if $(STOCK_REQS),$(STOCK_VENV)/.installed-$(shell cat $(STOCK_REQS) | cksum | cut -d' ' -f1))

ifneq ($(STOCK_STAMP),)
$(STOCK_STAMP): $(STOCK_REQS)
	$(PYTHON) -m venv $(STOCK_VENV)
	$(STOCK_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(STOCK_REQS)
	rm -f $(STOCK_VENV)/.installed-* && touch $@
endif

install: $(STAMP) $(EP_STAMP) $(STOCK_STAMP)

## demo: start the local stack and a worker, run examples/txt2img.json end to end
## (CONFIG=path/to/stack.yaml: another stack file, e.g. a copy of temporal-dev.yaml with its ports moved)
demo: $(STAMP) $(EP_STAMP)
	$(BIN)/python -m devstack.demo $(if $(CONFIG),--config '$(CONFIG)')

## demo-chaos: the demo's job with its worker kill -9'ed mid-job and its socket cut; prints the timeline
## (CONFIG=path/to/stack.yaml as for demo)
.PHONY: demo-chaos
demo-chaos: $(STAMP)
	$(BIN)/python -m faults.demo $(if $(CONFIG),--config '$(CONFIG)')

## test: unit, workflow (time-skipping), integration (real Temporal + SeaweedFS + simulator)
## (TEST_WORKERS=N: pytest-xdist processes, each with its own local stack; 1 runs them in one.
## 4 on 2 cores, since most tests wait on services, timers and leases: 9 min 21 s to 10 min 42 s
## (median 9 min 29 s) where 3 took 10 min 57 s to 12 min 59 s; the heavier load found a timing
## race in each of six runs, each fixed.) --dist loadfile: a file's tests run in one process, so its module fixtures
## (a worker, a pool's endpoint) start once, not once in each process that drew one of its tests.
TEST_WORKERS ?= 4
test: $(STAMP) $(EP_STAMP) $(STOCK_STAMP) debs
	REQUIRE_CHROMIUM=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Debian's nginx-light (grpc_pass, http2): tests/stack/test_tls_connection.py puts a TLS front that
# requires client certificates before the dev server, so the production connection path is run.
.PHONY: nginx
nginx:
	@test -x /usr/sbin/nginx || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; }

# Debian's chromium: the headless browser of `make test-ui` (the Temporal UI and the gateway's
# page, tests/support/chromium.py).
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# Both Debian packages the tests use, whichever are missing, in one apt-get call (`make test`
# runs the browser tests too), rather than updating the package lists twice.
.PHONY: debs
debs:
	@missing="$$(test -x /usr/sbin/nginx || echo nginx-light) $$(command -v chromium >/dev/null || echo chromium)"; \
	test -z "$$(echo $$missing)" || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; }

## test-real-comfyui: the conformance suite and end-to-end tests against a real ComfyUI: on a
## comfyui pool, and on the RunPod path (our handler, and the stock worker-comfyui handler when
## .venv-stock has it, under the RunPod simulator with a real ComfyUI per worker)
test-real-comfyui: $(STAMP) $(EP_STAMP) $(STOCK_STAMP)
	@test -n "$(REAL_COMFYUI)" -a -x "$(REAL_COMFYUI)" || { echo "no real-comfyui installer: set REAL_COMFYUI=path/to/real-comfyui (docs/testing.md)" >&2; exit 2; }
	$(REAL_COMFYUI) install $(REAL_COMFYUI_DIR)
	REAL_COMFYUI_DIR=$(abspath $(REAL_COMFYUI_DIR)) $(BIN)/pytest -q --durations=10 \
		tests/tooling/test_comfy_sim_conformance.py tests/stack/test_real_comfyui.py \
		tests/stack/test_real_comfyui_runpod.py

## test-ui: the Temporal UI shows a running job's live progress, and the gateway's browser page
## follows a job through a gateway kill -9 to its image (headless Chromium from Debian)
test-ui: $(STAMP) chromium
	REQUIRE_CHROMIUM=1 $(BIN)/pytest -q tests/client/test_temporal_ui.py tests/gateway/test_gateway_page.py \
		tests/gateway/test_gateway_page_batches.py

## mutate: mutation testing of workflows/ and the follower against the fast tests (not in `make test`)
.PHONY: mutate
mutate: $(STAMP)
	rm -rf mutants
	$(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

## mutate-module: the same for one module's mutants only, e.g. MODULE=workflows/graph.py (each
## mutant runs only the configured fast tests that call the function it changed, fastest first)
.PHONY: mutate-module
mutate-module: $(STAMP)
	@test -f "$(MODULE)" || { echo "usage: make mutate-module MODULE=workflows/graph.py" >&2; exit 2; }
	rm -rf mutants
	$(BIN)/mutmut run --max-children 2 '$(subst /,.,$(MODULE:.py=)).*'
	@$(BIN)/mutmut results | grep -F '$(subst /,.,$(MODULE:.py=)).' || echo "no surviving mutants"

## bench: the benchmarks (bench/) on a local stack of their own; writes bench/results.json and
## bench/RESULTS.md. BENCH=overhead,throughput,recovery,scale,offload,history,client_latency,push,runpod,queue,batch,pools picks
## some (all by default), N= the repetitions where a benchmark repeats (30), NOTE= what else ran
## (into RESULTS.md; no quotes in it); more options (--scale-jobs 100,300,1000,
## --offload-sizes 100, ...): .venv/bin/python -m bench --help
.PHONY: bench
bench: $(STAMP)
	$(BIN)/python -m bench $(if $(BENCH),--only '$(BENCH)') $(if $(N),-n $(N)) \
		$(if $(NOTE),--note '$(NOTE)') \
		--command 'make bench$(if $(BENCH), BENCH=$(BENCH))$(if $(N), N=$(N))'

## soak: MINUTES of mixed detached jobs on every pool kind with a random fault every FAULT_EVERY
## seconds, on a stack of its own, then the audit (docs/reliability.md); not part of `make test`.
## SEED= replays a run's mix and faults, JOBS_PER_MINUTE= the pace, STOCK=real|standin|off the
## claims: false pool (default: the real stock handler when .venv-stock has it), KEEP=1 its logs.
MINUTES     ?= 15
FAULT_EVERY ?= 20
.PHONY: soak
soak: $(STAMP) $(EP_STAMP) $(STOCK_STAMP)
	$(BIN)/python -m faults.soak --minutes $(MINUTES) --fault-every $(FAULT_EVERY) \
		$(if $(SEED),--seed $(SEED)) $(if $(JOBS_PER_MINUTE),--jobs-per-minute $(JOBS_PER_MINUTE)) \
		$(if $(STOCK),--stock $(STOCK)) $(if $(KEEP),--keep)

## lint: ruff (format + check) and mypy
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy .

## down: stop everything `make demo` / `durable-comfy dev up` started
## (CONFIG=path/to/stack.yaml: that stack's, by the PIDs in its state dir)
down: $(STAMP)
	$(BIN)/durable-comfy dev down $(if $(CONFIG),--config '$(CONFIG)')

# With CONFIG, only that stack is stopped: .devstack is the default stack's, which may still run.
clean: down
	$(if $(CONFIG),@echo "kept .devstack (the default stack's); remove $(CONFIG)'s state_dir yourself",rm -rf .devstack)
