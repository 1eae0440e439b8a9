#!/usr/bin/env bash
# Mutation check for the suite's strengthened assertions (issue 26).
#
# Each tests/mutants/*.patch breaks product or testbed code the way one test should catch.
# Its header names those tests, one line each:
#     # kills: tests/e2e/test_x.py::test_name
# followed by a plain unified diff (git diff, paths relative to the repo root).
#
# For every patch: a throwaway worktree of HEAD, the patch applied there, and the named
# tests run against it (PYTHONPATH puts the worktree's operator/ and testbed/ before the
# editable install; .cache is shared, so binaries and images are not rebuilt). A mutant is
# KILLED when every test it names FAILED in its own body (pytest's FAILED line: an
# assertion or an exception in the test, not a fixture's setup ERROR); a `kills:` line that
# names a module or a parametrized test needs one of its cases to fail. It SURVIVED when a
# named test did not fail, and is an ERROR when the patch does not apply. Before the
# mutants, the named tests run once on unmutated HEAD the same way and must pass, so a test
# that fails anyway cannot count as a kill (MUTANTS_SKIP_BASELINE=1 skips that).
#
# Usage: hack/mutants.sh [PATCH...]     (default: every tests/mutants/*.patch)
# Exit status: 0 when every mutant was killed, 1 otherwise.
set -uo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
py="$root/.venv/bin/python"
[ -x "$py" ] || { echo "mutants: no .venv here; run 'make venv' first" >&2; exit 2; }
if [ $# -gt 0 ]; then patches=("$@"); else patches=(tests/mutants/*.patch); fi
for i in "${!patches[@]}"; do patches[$i]=$(realpath "${patches[$i]}"); done
[ -e "${patches[0]}" ] || { echo "mutants: no patches under tests/mutants/" >&2; exit 2; }

worktrees=()
cleanup() {
  for wt in "${worktrees[@]}"; do git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1; done
}
trap cleanup EXIT

new_worktree() {  # a detached worktree of HEAD sharing this checkout's .venv and .cache
  local wt
  wt=$(mktemp -d /tmp/cachewarm-mutant.XXXXXX)
  rmdir "$wt"
  git -C "$root" worktree add --quiet --detach "$wt" HEAD || return 1
  ln -s "$root/.cache" "$wt/.cache"
  ln -s "$root/.venv" "$wt/.venv"
  echo "$wt"
}

run_tests() {  # run_tests WORKTREE LOG TEST... ; prints pytest's exit status
  local wt=$1 log=$2
  shift 2
  (cd "$wt" && PYTHONPATH="$wt/operator:$wt/testbed" "$py" -m pytest -q -rfE -p no:cacheprovider "$@" >"$log" 2>&1)
  echo $?
}

kills_of() { sed -n 's/^# kills: *//p' "$1"; }

logdir=$(mktemp -d /tmp/cachewarm-mutants-logs.XXXXXX)
echo "mutants: logs in $logdir"

if [ "${MUTANTS_SKIP_BASELINE:-0}" != 1 ]; then
  mapfile -t all < <(for p in "${patches[@]}"; do kills_of "$p"; done | sort -u)
  wt=$(new_worktree) || { echo "mutants: could not make a worktree" >&2; exit 2; }
  worktrees+=("$wt")
  rc=$(run_tests "$wt" "$logdir/baseline.log" "${all[@]}")
  if [ "$rc" != 0 ]; then
    echo "mutants: the named tests do not pass on unmutated HEAD (pytest exit $rc); see $logdir/baseline.log" >&2
    tail -20 "$logdir/baseline.log" >&2
    exit 1
  fi
  echo "baseline   ${#all[@]} tests pass on HEAD"
fi

killed=0 total=0
for patch in "${patches[@]}"; do
  total=$((total + 1))
  name=$(basename "$patch" .patch)
  mapfile -t kills < <(kills_of "$patch")
  if [ ${#kills[@]} -eq 0 ]; then echo "ERROR      $name: no '# kills:' line"; continue; fi
  wt=$(new_worktree) || { echo "ERROR      $name: no worktree"; continue; }
  worktrees+=("$wt")
  if ! git -C "$wt" apply "$patch" 2>"$logdir/$name.apply"; then
    echo "ERROR      $name: does not apply to HEAD ($(head -1 "$logdir/$name.apply"))"
    continue
  fi
  rc=$(run_tests "$wt" "$logdir/$name.log" "${kills[@]}")
  survivors=()
  for k in "${kills[@]}"; do  # each named test (or one case of it) FAILED in its body
    grep -q -F -e "FAILED $k" "$logdir/$name.log" || survivors+=("$k")
  done
  if [ ${#survivors[@]} -eq 0 ]; then
    killed=$((killed + 1)); echo "KILLED     $name ($(grep -m1 '^FAILED' "$logdir/$name.log" | cut -c1-120))"
  else
    echo "SURVIVED   $name: did not fail (pytest exit $rc): ${survivors[*]}; see $logdir/$name.log"
  fi
  git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1
done
echo "mutants: $killed of $total killed"
[ "$killed" -eq "$total" ]
