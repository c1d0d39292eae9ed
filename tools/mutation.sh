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
# only the mutants on each FUNCTION's own lines, not on the helpers it calls, which several
# functions share; SAMPLE drawn for each FUNCTION, with a seed of its own made from its name, so
# that the same FUNCTION draws the same mutants whatever else is named.
# A mutant's tests, cheapest first: for gather_utils.py, test_gather.py as pytest runs it, its
# tests in one process, then those under torchrun; for guard.py, tests/test_guard.py. Each stops
# at its first failure.
# Kept in a folder it prints first (OUT, else a new one): the unmutated run's output, then, for each
# mutant, its diff, its outcome and its tests' output (mutants/), and a table of them all
# (mutants.tsv). A mutant is killed by a failure, or by a timeout where the first failure the tests
# met was a time limit (a collective past its timeout, a launch or a test past its limit); the
# counts keep the two apart. Prints each survivor's diff, then each FUNCTION's counts. A run
# stopped early: `python3 FOLDER/draw.py FOLDER/session.sqlite FILE report` reports what ran.
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
keep=${OUT:-$(mktemp -d /tmp/mutation-out.XXXXXX)}
mkdir -p "$keep/mutants"
echo "tools/mutation.sh: output kept in $keep"
work=$(mktemp -d /tmp/mutation.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/repo"
# Everything on stdout: cosmic-ray keeps a mutant's stdout with its result, and drops its stderr.
cat >"$work/tests.sh" <<'EOF'
cd "$(dirname "$0")/repo"
run() {  # pytest's arguments: its output, between lines that name the step and its exit code
    echo "== step: pytest $*"
    local code=0
    # -n 0: one test at a time, in order, in one process (pytest.ini's default runs two)
    python3 -m pytest -q -x -n 0 -p no:cacheprovider "$@" 2>&1 || code=$?
    echo "== exit $code: pytest $*"
    return "$code"
}
if [[ $1 == guard.py ]]; then
    run tests/test_guard.py
else
    run test_gather.py -k "not torchrun" && run test_gather.py -k torchrun
fi
EOF
# Above the tests' own limits (600 s a test, 240 s a launch), which end a hang: a mutant past
# cosmic-ray's would count as a timeout, though only a slow machine took it there.
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
if ! bash "$work/tests.sh" "$file" >"$keep/unmutated.log" 2>&1; then
    echo "tools/mutation.sh: error: the tests fail on the unmutated $file; expected them to" \
        "pass (the tests this script's header names, on this machine): $keep/unmutated.log" >&2
    exit 1
fi
cd "$work/repo"
cosmic-ray init "$work/config.toml" "$keep/session.sqlite"
cat >"$keep/draw.py" <<'EOF'
"""draw.py SESSION FILE SAMPLE [FUNCTION ...]: keep the drawn mutants.
draw.py SESSION FILE report: each mutant's files and table, then each FUNCTION's counts."""
import ast, hashlib, os, random, re, sqlite3, sys

session, source, sample, *functions = sys.argv[1:]
db = sqlite3.connect(session)
# A first failure that was a time limit's: gloo's, pytest-timeout's, test_gather.py's for a launch.
TIMEOUT = re.compile(r"Timed out waiting \d+ms|Timeout >[\d.]+s|still running after \d+ s")


def spans():
    """{top-level name: (first line, last line)}: every def, class, assignment."""
    found = {}
    for node in ast.parse(open(source).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        else:
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        found.update({name: (first, node.end_lineno) for name in names})
    return found


def outcome(test_outcome, output):
    """killed, timeout or survived (or cosmic-ray's own word: incompetent)."""
    if test_outcome.lower() != "killed":
        return test_outcome.lower()
    if output == "timeout":  # cosmic-ray's own limit
        return "timeout"
    failed = re.findall(r"^== step: .*?\n(.*?)^== exit [1-9]", output or "", re.S | re.M)
    return "timeout" if failed and TIMEOUT.search(failed[-1]) else "killed"


def report():
    """Each mutant's diff, outcome and output in mutants/, one row each in mutants.tsv (printed),
    then each function's counts."""
    folder = os.path.dirname(os.path.abspath(session))
    rows = db.execute(
        "select function, start_pos_row, operator_name, occurrence, test_outcome, diff, output"
        " from drawn join mutation_specs using (job_id) join work_results using (job_id)"
        " order by drawn.rowid"
    ).fetchall()
    counts = {}
    with open(os.path.join(folder, "mutants.tsv"), "w") as table:
        for function, line, operator, occurrence, test_outcome, diff, output in rows:
            result = outcome(test_outcome, output)
            changed = [d[1:].strip() for d in (diff or "").splitlines()
                       if d[:1] in "-+" and not d.startswith(("---", "+++"))]
            name = f"{line}-{operator.rsplit('/', 1)[-1]}-{occurrence}"
            row = [function, name, result, " => ".join(changed)]
            table.write("\t".join(row) + "\n")
            print(*row, sep="\t")
            path = os.path.join(folder, "mutants", f"{function or 'file'}-{name}.txt")
            with open(path, "w") as f:
                f.write(f"{result}\n{operator} occurrence {occurrence}, line {line}\n")
                f.write(f"{diff}\n{output}")
            counts.setdefault(function, []).append(result)
    print(f"\n{'function':<24} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8}  bound")
    for function, results in counts.items():
        n, survived = len(results), results.count("survived")
        # With none surviving of n, the survival rate is below 1 - 0.05**(1/n) at 95% confidence.
        bound = f"survival < {100 * (1 - 0.05 ** (1 / n)):.0f}% (95%)" if not survived else ""
        killed, timeouts = results.count("killed"), results.count("timeout")
        print(f"{function or FILE:<24} {n:>7} {killed:>6} {timeouts:>7} {survived:>8}  {bound}")


FILE = os.path.basename(source)
if sample == "report":
    report()
    sys.exit()
# Drawn by what each mutant changes, not by its job id, which is new at every init.
specs = "select operator_name, occurrence, job_id, start_pos_row from mutation_specs"
if functions:
    found = spans()
    unknown = [f for f in functions if f not in found]
    if unknown:
        sys.exit(f"tools/mutation.sh: error: no top-level {', '.join(unknown)} in {source}")
    groups = {}
    for f in functions:
        first, last = found[f]
        mutants = sorted(m[:3] for m in db.execute(specs) if first <= m[3] <= last)
        groups[f] = mutants, int.from_bytes(hashlib.sha256(f.encode()).digest()[:8], "big")
else:
    groups = {"": (sorted(m[:3] for m in db.execute(specs)), 0)}
db.execute("create table drawn (function varchar, job_id varchar)")
for function, (mutants, seed) in groups.items():
    count = len(mutants) if sample == "all" else min(int(sample), len(mutants))
    drawn = random.Random(seed).sample(mutants, count)
    db.executemany("insert into drawn values (?, ?)", [(function, job) for *_, job in drawn])
kept = {job for job, in db.execute("select job_id from drawn")}
dropped = [(job,) for job, in db.execute("select job_id from mutation_specs") if job not in kept]
for table in ["mutation_specs", "work_items"]:
    db.executemany(f"delete from {table} where job_id = ?", dropped)
db.commit()
EOF
python3 "$keep/draw.py" "$keep/session.sqlite" "$file" "$sample" "${functions[@]}"
cosmic-ray exec "$work/config.toml" "$keep/session.sqlite"
cr-report "$keep/session.sqlite" --surviving-only --show-diff
python3 "$keep/draw.py" "$keep/session.sqlite" "$file" report
