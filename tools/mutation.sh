#!/usr/bin/env bash
# Mutation testing with cosmic-ray: each mutant is one small change to FILE (a flipped comparison,
# a constant off by one, a deleted statement, ...), and a mutant the tests do not fail on survives.
# The tests start torchrun, whose workers import the file from disk, so cosmic-ray changes the file
# itself: in a scratch clone of this repository's HEAD, never here.
#
#   python3 -m venv --system-site-packages /tmp/cr && /tmp/cr/bin/pip install cosmic-ray==8.7.0
#   PATH=/tmp/cr/bin:$PATH bash tools/mutation.sh gather_utils.py|guard.py [SAMPLE [FUNCTION ...]]
#
# SAMPLE: that many mutants drawn at random (seed 0) instead of all of them, for an estimate in
# less time ("all": every one). With FUNCTIONs (top-level names in FILE, e.g. all_gather_concat):
# only the mutants inside each FUNCTION and inside what it uses of FILE (its helpers, theirs, the
# constants they read), SAMPLE drawn for each FUNCTION; a mutant drawn for two runs once. Prints
# each survivor's diff, cosmic-ray's totals, then each FUNCTION's. A mutant's tests, cheapest
# first: for gather_utils.py, test_gather.py's checks in one process, then under torchrun on 3,
# 2, 1, 4 and 9 ranks (9: the checks pytest runs there), and on 3 ranks with --backend default;
# for guard.py, tests/test_guard.py.
set -euo pipefail
usage="usage: tools/mutation.sh gather_utils.py|guard.py [SAMPLE [FUNCTION ...]]"
file=${1:?$usage}
sample=${2:-all}
functions=("${@:3}")
if [[ $file != gather_utils.py && $file != guard.py ]]; then
    echo "tools/mutation.sh: error: FILE must be gather_utils.py or guard.py, got '$file'" >&2
    exit 2
fi
if [[ $sample != all && ! $sample =~ ^[1-9][0-9]*$ ]]; then
    echo "tools/mutation.sh: error: SAMPLE must be a positive number or 'all', got '$sample'" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/mutation.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/repo"
cat >"$work/tests.sh" <<'EOF'
cd "$(dirname "$0")/repo"
if [[ $1 == guard.py ]]; then
    exec python3 -m pytest -q -x -p no:cacheprovider tests/test_guard.py >/dev/null 2>&1
fi
python3 -m pytest -q -x -p no:cacheprovider test_gather.py -k "not torchrun" >/dev/null 2>&1 || exit 1
launch() {  # ranks, then test_gather.py's flags: every check passed
    local ranks=$1 last
    shift
    last=$(timeout 150 torchrun --standalone --nproc_per_node "$ranks" test_gather.py "$@" 2>&1 | tail -n 1)
    [[ $last == *" passed, 0 failed" ]]
}
for n in 3 2 1 4; do launch "$n" || exit 1; done
large=$(python3 -c 'import test_gather as t; print(t.LARGE_WORLD, ",".join(t.LARGE_WORLD_CHECKS))')
launch ${large% *} --checks "${large#* }" || exit 1
CUDA_VISIBLE_DEVICES= launch 3 --backend default
EOF
# Above the tests' own limits (600 s in one process, 150 s a launch), which end a hang: a mutant
# past cosmic-ray's would count as killed, though only a slow machine took it there.
cat >"$work/config.toml" <<EOF
[cosmic-ray]
module-path = "$file"
timeout = 1800.0
excluded-modules = []
test-command = "bash $work/tests.sh $file"

[cosmic-ray.distributor]
name = "local"
EOF
# Unmutated, the tests must pass: else every mutant would count as killed (torch not installed).
if ! bash "$work/tests.sh" "$file"; then
    echo "tools/mutation.sh: error: the tests fail on the unmutated $file; expected them to pass" \
        "(the tests this script's header names, on this machine)" >&2
    exit 1
fi
cd "$work/repo"
cosmic-ray init "$work/config.toml" "$work/session.sqlite"
cat >"$work/draw.py" <<'EOF'
"""draw.py SESSION FILE SAMPLE [FUNCTION ...]: keep the drawn mutants; report: each FUNCTION's."""
import ast, random, sqlite3, sys

session, source, sample, *functions = sys.argv[1:]
db = sqlite3.connect(session)


def owners():
    """{top-level name: (first line, last line, names it uses)}: every def, class, assignment."""
    found = {}
    for node in ast.parse(open(source).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        else:
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        found.update({name: (first, node.end_lineno, used) for name in names})
    return found


def pool(function, found):
    """(what it changes, job) of every mutant inside `function` or what it uses."""
    reach, todo = set(), [function]
    while todo:
        name = todo.pop()
        if name in found and name not in reach:
            reach.add(name)
            todo += found[name][2]
    lines = {line for name in reach for line in range(found[name][0], found[name][1] + 1)}
    specs = "select operator_name, occurrence, job_id, start_pos_row from mutation_specs"
    return sorted(m[:3] for m in db.execute(specs) if m[3] in lines)


if sample == "report":
    print(f"{'function':<24} {'mutants':>7} {'killed':>6} {'survived':>8} {'killed %':>8}")
    results = "select test_outcome from drawn join work_results using (job_id) where function = ?"
    for function, in db.execute("select distinct function from drawn order by rowid").fetchall():
        outcomes = [outcome.lower() for outcome, in db.execute(results, (function,))]
        killed = outcomes.count("killed")
        print(f"{function:<24} {len(outcomes):>7} {killed:>6} {outcomes.count('survived'):>8} "
              f"{100 * killed / max(len(outcomes), 1):>7.1f}%")
    sys.exit()
# Drawn by what each mutant changes, not by its job id, which is new at every init.
found = owners()
if functions:
    unknown = [f for f in functions if f not in found]
    if unknown:
        sys.exit(f"tools/mutation.sh: error: no top-level {', '.join(unknown)} in {source}")
    groups = {f: pool(f, found) for f in functions}
else:
    every = "select operator_name, occurrence, job_id from mutation_specs"
    groups = {"": sorted(db.execute(every))}
db.execute("create table drawn (function varchar, job_id varchar)")
for function, mutants in groups.items():
    count = len(mutants) if sample == "all" else min(int(sample), len(mutants))
    drawn = random.Random(0).sample(mutants, count)
    db.executemany("insert into drawn values (?, ?)", [(function, job) for *_, job in drawn])
kept = {job for job, in db.execute("select job_id from drawn")}
dropped = [(job,) for job, in db.execute("select job_id from mutation_specs") if job not in kept]
for table in ["mutation_specs", "work_items"]:
    db.executemany(f"delete from {table} where job_id = ?", dropped)
db.commit()
EOF
python3 "$work/draw.py" "$work/session.sqlite" "$file" "$sample" "${functions[@]}"
cosmic-ray exec "$work/config.toml" "$work/session.sqlite"
cr-report "$work/session.sqlite" --surviving-only --show-diff
if [[ ${#functions[@]} -gt 0 ]]; then
    python3 "$work/draw.py" "$work/session.sqlite" "$file" report
fi
