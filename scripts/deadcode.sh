#!/usr/bin/env bash
# Fails when a function nothing calls from tether's or tether-lab's main is
# left in the code, unless scripts/deadcode.allow documents why it stays.
# deadcode (golang.org/x/tools/cmd/deadcode, pinned in scripts/tools.sh)
# follows calls from the mains through the workspace (go.work), so code
# only the lab uses counts as used, and code only tests use as dead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin="$root/.tools/deadcode/deadcode"
found=$("$bin" ./cmd/tether ./lab/cmd/tether-lab)
allow=$(grep -v '^\s*\(#\|$\)' scripts/deadcode.allow | sed 's/\s*#.*$//')
left=$(printf '%s\n' "$found" | grep -v -E -f <(printf '%s\n' "$allow") || true)
if [ -n "$left" ]; then
	echo "deadcode: unreachable from tether's and tether-lab's mains:" >&2
	printf '%s\n' "$left" >&2
	echo "remove it, move what only tests need into a _test.go file, or document why it stays in scripts/deadcode.allow" >&2
	exit 1
fi
echo "deadcode: nothing unreachable outside scripts/deadcode.allow ($(printf '%s\n' "$found" | grep -c . || true) allowed)"
