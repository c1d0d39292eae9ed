#!/usr/bin/env bash
# Mutation testing with cosmic-ray: each mutant is one small change to FILE (a flipped comparison,
# a constant off by one, a deleted statement, ...), and a mutant the tests do not fail on survives.
# The tests start torchrun, whose workers import the file from disk, so cosmic-ray changes the file
# itself: in a scratch clone of this repository's HEAD, never here.
#
#   python3 -m venv --system-site-packages /tmp/cr && /tmp/cr/bin/pip install cosmic-ray==8.7.0
#   PATH=/tmp/cr/bin:$PATH bash tools/mutation.sh gather_utils.py|guard.py [SAMPLE]
#
# SAMPLE: that many mutants drawn at random (seed 0) instead of all of them, for an estimate in
# less time. Prints each survivor's diff, then cosmic-ray's totals. A mutant's tests, cheapest
# first: for gather_utils.py, test_gather.py's checks in one process, then under torchrun on 3,
# 2, 1 and 5 ranks, and on 3 ranks with --backend default; for guard.py, tests/test_guard.py.
set -euo pipefail
file=${1:?usage: tools/mutation.sh gather_utils.py|guard.py [SAMPLE]}
sample=${2:-}
if [[ $file != gather_utils.py && $file != guard.py ]]; then
    echo "tools/mutation.sh: error: FILE must be gather_utils.py or guard.py, got '$file'" >&2
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
for n in 3 2 1 5; do launch "$n" || exit 1; done
CUDA_VISIBLE_DEVICES= launch 3 --backend default
EOF
cat >"$work/config.toml" <<EOF
[cosmic-ray]
module-path = "$file"
timeout = 300.0
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
if [[ -n $sample ]]; then
    python3 - "$work/session.sqlite" "$sample" <<'EOF'
import random, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
# Drawn by what each mutant changes, not by its job id, which is new at every init.
mutants = sorted(db.execute("select operator_name, occurrence, job_id from mutation_specs"))
drawn = random.Random(0).sample(mutants, min(int(sys.argv[2]), len(mutants)))
dropped = {job for *_, job in mutants} - {job for *_, job in drawn}
for table in ["mutation_specs", "work_items"]:
    db.executemany(f"delete from {table} where job_id = ?", [(job,) for job in dropped])
db.commit()
EOF
fi
cosmic-ray exec "$work/config.toml" "$work/session.sqlite"
cr-report "$work/session.sqlite" --surviving-only --show-diff
