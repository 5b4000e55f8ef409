#!/usr/bin/env bash
# Runs every fuzz target for $1 each (a duration such as 10s, or a count
# such as 5000x). Targets are found, not listed: every `func FuzzX` in a
# *_test.go file git tracks or would add. -fuzz takes one target per
# package, so each gets its own go test, run in the directory of the module
# that holds it (the root, lab/ or e2e/: go test reaches one module's
# packages, with or without the workspace).
#
# A crasher fails the run and is written to <pkg>/testdata/fuzz/FuzzX/:
# commit it only as a regression seed, with the fix. The rest of the
# corpus stays in GOCACHE.
#
# Go 1.26's fuzz coordinator can end a duration run with a bare
# "context deadline exceeded" and no failing input (golang/go#75804, fixed
# in Go 1.27): the -fuzztime deadline races a busy worker's shutdown. That
# one result, and only it, runs the target once more; a second failure of
# any kind fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."

fuzztime=${1:-10s}
go=${GO:-go}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# toolchain_race: the run failed with the coordinator's deadline message
# as its only reason and wrote no failing input.
toolchain_race() {
	grep -Eqx '[[:space:]]+context deadline exceeded' "$log" &&
		! grep -q 'Failing input written to' "$log"
}

# module_of prints the directory of the go.mod that holds directory $1.
module_of() {
	local d=$1
	while [ "$d" != . ] && [ ! -f "$d/go.mod" ]; do d=$(dirname "$d"); done
	echo "$d"
}

for f in $(git ls-files --cached --others --exclude-standard '*_test.go' | xargs -r grep -l '^func Fuzz'); do
	dir=$(dirname "$f")
	mod=$(module_of "$dir")
	case $mod in
	.) pkg=./$dir/ ;;
	"$dir") pkg=./ ;;
	*) pkg=./${dir#"$mod"/}/ ;;
	esac
	for t in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$f" | cut -c6-); do
		for attempt in 1 2; do
			echo "fuzz $t ./$dir/ for $fuzztime"
			# $go unquoted: GO may carry words of its own (GO="env GOFLAGS=-x go").
			# shellcheck disable=SC2086
			if (cd "$mod" && $go test -run '^$' -fuzz "^$t\$" -fuzztime "$fuzztime" "$pkg") 2>&1 | tee "$log"; then
				break
			fi
			if [ "$attempt" = 1 ] && toolchain_race; then
				echo "fuzz $t: bare 'context deadline exceeded' with no failing input (golang/go#75804); running it once more"
				continue
			fi
			exit 1
		done
	done
done
