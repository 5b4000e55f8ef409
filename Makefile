# tether: `make run` starts the local stack, `make unit` runs the unit tests
# (about a minute), `make test` runs every test. Each target installs what it
# needs first (scripts/tools.sh, which pins every version).
#
# Three Go modules, joined by go.work for development: the product (the
# root), the lab (lab/: tether-lab and its packages) and the e2e tests
# (e2e/). `go test ./...` reaches the packages of the module it runs in, so
# the targets run it in each module's directory; each module also builds
# alone (GOWORK=off).

GO            ?= go
ENVOY_BIN     ?= $(CURDIR)/.tools/envoy/envoy/_bin/envoy
GOLANGCI_LINT ?= $(CURDIR)/.tools/golangci-lint/golangci-lint
export ENVOY_BIN GO

# The modules with packages to build, vet and unit-test (the e2e module
# holds only tests behind the e2e build tag), and all three.
CODE_MODULES := . lab
MODULES      := . lab e2e

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: tools
tools: ## Install everything the tests use: pinned Envoy and golangci-lint (.tools), redis-server, PostgreSQL, Prometheus (Debian)
	@scripts/tools.sh

.PHONY: build
build: ## Build bin/tether (the product) and bin/tether-lab (emulator, loadgen, bench, simulator)
	$(GO) build -o bin/tether ./cmd/tether
	cd lab && $(GO) build -o $(CURDIR)/bin/tether-lab ./cmd/tether-lab

.PHONY: run
run: build ## Local stack: 8 emulated A100s, tether (embedded store), Envoy on 127.0.0.1:10000 (installs Envoy only)
	@scripts/tools.sh envoy
	@scripts/run-local.sh

.PHONY: compose
compose: ## docker compose up (needs Docker): docker-compose.yml's stack with Redis, Prometheus and Grafana
	docker compose up --build

# The quick loop: no -race, no e2e, no fuzzing, and -short skips the tests
# that build the images' binaries. Tests that start redis-server,
# PostgreSQL, Envoy or promtool run when those are installed (make tools)
# and skip when not (they fail instead under CI=true).
.PHONY: unit
unit: ## Unit tests, about a minute: no -race, no e2e, no fuzz (make test runs them all)
	@set -e; for m in $(CODE_MODULES); do echo "cd $$m && $(GO) test -short ./..."; (cd $$m && $(GO) test -short ./...); done

.PHONY: test
test: tools lint ## Lint, then unit, conformance, fuzz (TEST_FUZZTIME each) and e2e tests (real Envoy, real redis-server), with -race
	@set -e; for m in $(CODE_MODULES); do echo "cd $$m && $(GO) test -race -count=1 ./..."; (cd $$m && $(GO) test -race -count=1 ./...); done
	@$(MAKE) --no-print-directory fuzz FUZZTIME=$(TEST_FUZZTIME)
	cd e2e && $(GO) test -race -count=1 -tags e2e -timeout 15m ./...

# Fuzz targets are found, not listed (scripts/fuzz.sh says how, and how it
# treats Go 1.26's fuzz deadline race). A crasher fails the run and is
# written to <pkg>/testdata/fuzz/FuzzX/.
FUZZTIME      ?= 10s
TEST_FUZZTIME ?= 5s

.PHONY: fuzz
fuzz: ## Run every fuzz target for FUZZTIME each (default 10s)
	@scripts/fuzz.sh $(FUZZTIME)

# golangci-lint runs go vet's analyzers (the e2e tests included), the
# linters and dependency rules of .golangci.yml, and gofmt; gofmt -l also
# covers the files no build on this machine compiles. golangci-lint's ./...
# stops at a nested go.mod, as go's does: it runs in each module's
# directory, on the root's .golangci.yml (whose depguard paths are relative
# to it). `go mod tidy -diff`, without the workspace, checks that each
# go.mod and go.sum is whole on its own: the product's lists nothing the lab
# alone needs. deadcode (scripts/deadcode.sh) fails on a function nothing
# calls from the two mains, unless scripts/deadcode.allow says why it stays.
# scripts/longest.go prints the product's longest functions and fails on one
# over 100 lines or nested deeper than 4.
.PHONY: lint
lint: ## gofmt, go mod tidy, golangci-lint in each module (.golangci.yml: go vet, errcheck, staticcheck, ineffassign, unused, revive, unparam, errorlint, depguard's dependency rules), deadcode, function length and depth (scripts/longest.go)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@set -e; for m in $(MODULES); do echo "cd $$m && GOWORK=off $(GO) mod tidy -diff"; (cd $$m && GOWORK=off $(GO) mod tidy -diff); done
	@scripts/tools.sh golangci-lint deadcode
	@set -e; for m in $(MODULES); do echo "cd $$m && $(GOLANGCI_LINT) run --config $(CURDIR)/.golangci.yml ./..."; (cd $$m && $(GOLANGCI_LINT) run --config $(CURDIR)/.golangci.yml ./...); done
	@scripts/deadcode.sh
	@$(GO) run scripts/longest.go -top 10

# The bench measures tether against SGLang's and vLLM's routers, from PyPI
# (scripts/tools.sh peers): only make bench installs them, never make tools.
.PHONY: bench
bench: build ## Benchmark suite through real Envoy and redis-server, beside sglang-router and vllm-router (~45 min): writes BENCHMARKS.md and docs/bench/*.png
	@scripts/tools.sh envoy redis peers
	bin/tether-lab bench --envoy $(ENVOY_BIN) --peers $(CURDIR)/.tools/peers --scale full --out BENCHMARKS.md --charts docs/bench

# The soak is run by hand, never by make test: it takes SOAK_DURATION. It
# fails when tether's RSS or goroutine count is not flat (lab/bench/soak.go
# states the rule) and writes docs/soak.md either way.
SOAK_DURATION ?= 10m

.PHONY: soak
soak: build ## Soak benchmark, 10 min, not part of make test: tether's RSS and goroutines under steady load (docs/soak.md)
	@scripts/tools.sh envoy redis
	bin/tether-lab bench soak --envoy $(ENVOY_BIN) --duration $(SOAK_DURATION) --out docs/soak.md --chart docs/bench/soak.png

.PHONY: bench-go
bench-go: ## Go benchmarks of the decision path (memory store, embedded, miniredis, redis-server)
	@scripts/tools.sh redis
	$(GO) test -run '^$$' -bench . -benchmem ./identity/ ./affinity/ ./store/... ./extproc/
	cd lab && $(GO) test -run '^$$' -bench . -benchmem ./emulator/...

.PHONY: envoy-config
envoy-config: ## Regenerate envoy/*.yaml and the xds golden files from the builder
	$(GO) test ./xds -run 'TestEnvoyFiles|TestGoldenADSResources' -update

.PHONY: clean
clean: ## Remove build output (keeps .tools)
	rm -rf bin
