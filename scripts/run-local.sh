#!/usr/bin/env bash
# The local stack on embedded defaults: eight emulated A100 instances, tether
# with its in-process store and its ADS server, and Envoy on 127.0.0.1:10000
# started from envoy/bootstrap-xds.yaml (ENVOY_CONFIG=envoy/envoy-static.yaml
# runs it without xDS). Ctrl-C stops everything this script started.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
config=deploy/local/tether.toml
tether=bin/tether
lab=bin/tether-lab
envoy=${ENVOY_BIN:-$root/.tools/envoy/envoy/_bin/envoy}
logs=$(mktemp -d "${TMPDIR:-/tmp}/tether-local.XXXXXX")

pids=()
stop() {
	trap - INT TERM EXIT
	echo
	echo "stopping…"
	for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	echo "logs kept in $logs"
}
# Ctrl-C or kill: stop everything and exit as the signal asks; any other
# exit (a component failed to start) stops the rest too.
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

"$tether" config validate "$config"
"$lab" emulate --config "$config" 2>"$logs/emulate.log" &
pids+=($!)
"$tether" serve --config "$config" 2>"$logs/tether.log" &
pids+=($!)
"$envoy" -c "${ENVOY_CONFIG:-envoy/bootstrap-xds.yaml}" --disable-hot-restart --log-level warn 2>"$logs/envoy.log" &
pids+=($!)

wait_http() { # url what
	for _ in $(seq 1 100); do
		if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
		for pid in "${pids[@]}"; do
			kill -0 "$pid" 2>/dev/null || { echo "$2 exited; see $logs" >&2; tail -n 20 "$logs"/*.log >&2; exit 1; }
		done
		sleep 0.1
	done
	echo "$2 did not come up at $1; see $logs" >&2
	exit 1
}
wait_http http://127.0.0.1:8090/readyz tether
wait_http http://127.0.0.1:9901/ready envoy
wait_http http://127.0.0.1:8101/healthz emulator

cat <<MSG

tether local stack is up (logs: $logs)
  Envoy      http://127.0.0.1:10000   (admin http://127.0.0.1:9901), configured by tether over ADS
  tether     ext_proc 127.0.0.1:50051, ADS 127.0.0.1:18000, admin http://127.0.0.1:8090
             (/healthz /readyz /metrics /v1/instances /v1/xds); edit $config and Envoy follows
  instances  a100-east-1..4 (us-east-1a), a100-west-1..4 (us-west-2b) on 127.0.0.1:8101-8104, 8201-8204

Try it (run it twice: the same session lands on the same instance):
  curl -si http://127.0.0.1:10000/v1/chat/completions -H 'content-type: application/json' \\
    -H 'x-session-id: demo-1' -d '{"model":"llama-3.1-8b","messages":[{"role":"user","content":"hello"}]}' \\
    | grep -iE '^x-(instance|tether)'

Ctrl-C stops everything.
MSG
wait -n "${pids[@]}" || true
echo "a component exited; see $logs" >&2
exit 1
