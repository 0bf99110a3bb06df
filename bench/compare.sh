#!/usr/bin/env bash
# Interleaved runs of a benchmark on an earlier commit and on this checkout, so both see
# the same machine at the same times (on a 2-core VM a run can vary by a third).
#
#   bash bench/compare.sh REV RUNS BENCH [ARGS...]
#   bash bench/compare.sh 6e6e983 3 claims.py --db postgresql://postgres@127.0.0.1:5432/test
#
# REV is checked out into a temporary worktree and run with its own bench script and
# PYTHONPATH=<worktree>/src, under this checkout's .venv. Prints each run's last line
# (TAIL=N: its last N lines).
set -euo pipefail
rev=$1 runs=$2 bench=$3
shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || rm -rf "$old"' EXIT
git -C "$here" worktree add --detach --force "$old" "$rev" >/dev/null 2>&1
py="$here/.venv/bin/python"
for i in $(seq "$runs"); do
  echo "before ($rev): $(PYTHONPATH="$old/src" "$py" "$old/bench/$bench" "$@" 2>&1 | tail -n "${TAIL:-1}")"
  echo "after (this checkout): $(cd "$here" && "$py" "bench/$bench" "$@" 2>&1 | tail -n "${TAIL:-1}")"
done
