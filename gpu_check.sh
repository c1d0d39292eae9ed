#!/usr/bin/env bash
# The GPU proof in one try, on one CUDA machine, with the python3 it finds (torch 2.3 or later with
# torchvision; nothing installed), inside a deadline. The steps are in `plan` below, most valuable
# first: the gather tests over NCCL, then over gloo with CUDA tensors, and over train_ddp.py's
# group of gloo and NCCL; the headline
# figure, train_ddp.py's ResNet-50 at 224 px in bf16 (batch 256, synthetic data), under
# check_syncs.py (no host-device sync between log lines); what a collective past
# --collective-timeout shows on NCCL; train_ddp.py on NCCL in fp16 with the fp16 hook (after a first
# step made to overflow) under check_syncs.py; a CPU checkpoint resumed on the GPU with
# --channels-last; two ranks sharing the GPU over gloo (SyncBN statistics and DDP replicas against
# one process); SIGTERM mid-epoch; on torch 2.15 or later, the collective past its timeout again
# on the old ProcessGroupNCCL; --compile.
# Which NCCL: torch before 2.15 has one, ProcessGroupNCCL, and every NCCL step runs on it. On torch
# 2.15 or later `nccl` is ProcessGroupNCCL2, and every NCCL step runs on it but
# nccl_timeout_legacy, which runs nccl_timeout's collective past its timeout on the old
# ProcessGroupNCCL (TORCH_DIST_USE_NCCL2=0). Steps that run train_ddp.py's group on GPUs use gloo
# for its CPU tensors beside NCCL; the two ranks sharing the GPU use gloo alone. summary.json and
# the final table give each step's backend, and the timeout steps check the NCCL class they ran.
#
#   bash gpu_check.sh                 # on the GPU machine: DEADLINE seconds from its start (default 540)
#   bash gpu_check.sh --rehearse      # without a GPU: the same steps and checks on the CPU at toy sizes (the
#                                     # steps that need CUDA are skipped), to prove the script itself and time it,
#                                     # in a venv without pytest, scikit-learn and pynvml, as the GPU machine
#   ONLY="headline resume" bash gpu_check.sh --rehearse    # only these steps
#
# Every step runs whatever failed before it, under a time limit of its own, and asserts its result.
# Past its limit a step's processes get SIGABRT (PYTHONFAULTHANDLER=1: every thread's stack goes to
# its log), then SIGKILL. A step starts only if the deadline leaves it the time its process starts
# take (START_SECONDS each); the rest are listed as skipped, and the check is then incomplete (so is
# a step that the deadline, not its own limit, cut short); a step this torch has nothing for is
# listed as not applicable, which is no failure and leaves the check complete. Without a GPU and
# without --rehearse it refuses at once.
# A TERM or INT, also to its whole process group (timeout, ^C), ends the step in flight and removes
# the work folder. Out ($OUT, else a new folder it names): gpu_check.log; summary.json, rewritten
# after every step, each step's seconds beside its estimate; logs/NAME.log, written as each step
# runs and packed into step_logs.tar.gz at the end (also on SIGTERM). Exit code: 1 if any step
# failed or timed out, else 2 if the deadline skipped any (incomplete), else 0.
#
# What one GPU cannot show: NCCL between ranks. NCCL refuses two ranks on one GPU, so its multi-rank paths
# (gather_utils' uneven all-gather, the header exchange between ranks, DDP's all-reduce, SyncBN over NCCL) run
# only at world size 1 here; two ranks share the GPU over gloo instead.

set -uo pipefail
cd "$(dirname "$0")"

# The plan, most valuable first, so that a deadline that comes early cuts the least; --compile,
# last, costs the most for what it adds. For each step: the processes it starts that import torch
# (python, torch, CUDA and NCCL take 10 to 15 s to start: START_SECONDS each), and its seconds of
# work on an H200 (none has run this yet); its estimate is starts x START_SECONDS + work.
# probes_and_checks counts the same way the probe before the first step and the checks after each
# (torch imported by the probe and by the two checks that read a checkpoint). On the GPU machine's
# torch 2.11: 19 starts, 409 s, 76% of the deadline, whose rest is for estimates that are low. torch
# 2.15 made its `nccl` backend ProcessGroupNCCL2 and kept the old ProcessGroupNCCL behind
# TORCH_DIST_USE_NCCL2=0: there from_torch_2_15 runs the timeout step again on the old one, where
# the two differ, 49 s more (458 s, 85%; after it only --compile, the first that a deadline would
# cut). The old one's gathers are the same code as gather_nccl's NCCL run before 2.15. Before 2.15
# the step is listed as not applicable, and costs nothing. gather_nccl's work: 15 s for NCCL's
# checks, 5 for gloo's (a world of one's checks took 5 s on 2 shared CPU cores, CPU tensors).
# Left out, as adding little on one GPU to what the CPU's tests prove: --evaluate, a fine-tune from
# --weights, the rest of an epoch after SIGTERM, the PowerSGD hook (torch's own code on NCCL), bf16
# and channels-last at 64 px beside the headline's, and JPEG photographs (at a size that fits, their
# batches are fewer than the workers prefetch: a measure of the workers' start, not of the input
# pipeline). Left out to fit the deadline, as other steps prove what they did: fp32 training under
# check_syncs.py (the headline runs train_ddp.py under it in bf16, fp16 runs the GradScaler; fp32
# only leaves autocast off); ResNet-50's speed with and without DDP (bench_train.py: the headline
# gives train_ddp.py's own images/s, and DDP's all-reduce at world size 1 moves nothing between
# GPUs); the gather tests over gloo with CUDA tensors on 2 ranks (gather_nccl runs them on one,
# where every gather still copies its CUDA tensors through the host and back).
START_SECONDS=12
plan=(gather_nccl 2 20
      gather_mixed_group 1 8
      headline 1 22
      nccl_timeout 2 25
      train_fp16_hook_fp16 2 12
      resume 2 12
      shared_device_sync_bn_and_replicas 3 6
      sigterm 1 6
      nccl_timeout_legacy 2 25
      compile 2 65)
from_torch_2_15=(nccl_timeout_legacy)
probes_and_checks=(3 5)
rehearse=0
if [[ ${1:-} == --rehearse ]]; then rehearse=1; fi
planned() {  # name: the index of that step in the plan, if it has it
    local i
    for ((i = 0; i < ${#plan[@]}; i += 3)); do
        [[ ${plan[i]} == "$1" ]] && echo "$i" && return
    done
    return 1
}
starts() {  # name: the processes that step starts that import torch
    local i
    i=$(planned "$1") && echo "${plan[i + 1]}"
}
estimate() {  # name: that step's estimated seconds on an H200
    local i
    i=$(planned "$1") && echo $((plan[i + 1] * START_SECONDS + plan[i + 2]))
}
read -ra only <<<"${ONLY:-}"  # the names, split on any blanks, never globbed
for name in "${only[@]}"; do  # a misspelt name would leave nothing to run, and a check that passes
    if ! planned "$name" >/dev/null; then
        echo "gpu_check.sh: error: ONLY names no step '$name'; expected names from the plan:" \
            "$(for ((i = 0; i < ${#plan[@]}; i += 3)); do printf '%s ' "${plan[i]}"; done)" >&2
        exit 2
    fi
done
py=python3
probe() {  # the versions, and whether torch sees a GPU (the exit status): one import of torch for both
    timeout 60 $py -c 'import os, sys, torch, torchvision
cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__,
      "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
      "GPUs", torch.cuda.device_count(), "cores", len(os.sched_getaffinity(0)))
sys.exit(not cuda)'
}
if ((!rehearse)) && ! versions=$(probe 2>/dev/null); then
    echo "gpu_check.sh: error: torch sees no CUDA GPU here; expected the GPU machine, or --rehearse on a CPU" >&2
    exit 2
fi
out=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
logs=$out/logs
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")  # checkpoints and data: not copied back
mkdir -p "$logs"
# tee ignores TERM and INT: a signal to the whole process group (timeout, ^C) must leave it to write the
# trap's lines, or the trap's first write would kill the shell before it ends the step in flight.
exec > >(trap '' TERM INT; exec tee "$out/gpu_check.log") 2>&1
deadline=${DEADLINE:-540}  # from the script's start, as SECONDS counts: the probe and the set-up too
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc heeds them: the cores we may use
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN
unset TORCH_DIST_USE_NCCL2  # torch's own NCCL, as each step's backend says, unless the step sets it
if ((rehearse)); then
    # What the GPU machine lacks is missing here too, so that a rehearsal fails where the one try would: a virtual
    # environment with this python's packages but pytest, scikit-learn and pynvml.
    $py -m venv --without-pip "$work/venv"
    mkdir "$work/packages"
    for entry in "$($py -c 'import site; print(site.getsitepackages()[0])')"/*; do
        case ${entry##*/} in pytest* | _pytest | sklearn | scikit_learn* | pynvml* | __pycache__) ;;
            *) ln -s "$entry" "$work/packages/" ;;
        esac
    done
    py=$work/venv/bin/python
    echo "$work/packages" >"$($py -c 'import site; print(site.getsitepackages()[0])')/gpu_machine.pth"
    versions=$(probe)
    # One thread a process: on a CPU that others share, threads that wait for each other spin, and
    # with 4 the steps ran into their own limits.
    export OMP_NUM_THREADS=1
fi
names=() results=() seconds=() notes=() backends=() deadline_skipped=0
running= current= current_began= finished=false failed=0 incomplete=0

# The pid of the step in flight, and every process under it (torchrun starts its workers in sessions of their own).
tree() {
    timeout 10 $py - "$1" <<'EOF'
import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # timeout gives it TERM back: the traps' second TERM must not end it
signal.signal(signal.SIGINT, signal.SIG_IGN)
parents = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        ppid = next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("PPid:"))
    except (OSError, StopIteration):
        continue
    parents.setdefault(ppid, []).append(pid)
todo, found = [sys.argv[1]], []
while todo:
    found.append(todo.pop())
    todo += parents.get(found[-1], [])
print(*found)
EOF
}

# SIGABRT first: each Python process writes every thread's stack to the step's log. Then SIGKILL, to processes
# stopped first, so that none of them can start another or be reparented while the rest die.
kill_tree() {
    local pids
    pids=$(tree "$1")
    kill -ABRT $pids 2>/dev/null
    sleep 2
    pids="$pids $(tree "$1")"
    kill -STOP $pids 2>/dev/null
    kill -KILL $pids 2>/dev/null
}

verdict() {  # failed: the steps that failed, timed out or were stopped; incomplete: those the deadline skipped
    local i
    failed=0 incomplete=0
    for i in "${!names[@]}"; do
        case ${results[$i]} in
            pass | "not applicable") ;;
            skipped) [[ ${notes[$i]} != deadline ]] || incomplete=$((incomplete + 1)) ;;
            *) failed=$((failed + 1)) ;;
        esac
    done
}

write_summary() {  # written whole, then renamed: a kill leaves the last complete one
    local i sep= complete=false
    verdict
    $finished && ((incomplete == 0)) && complete=true
    {
        printf '{"deadline_seconds": %d, "rehearsal": %s, "finished": %s, "failed": %d, "skipped_by_deadline": %d, ' \
            "${DEADLINE:-540}" "$( ((rehearse)) && echo true || echo false)" "$finished" "$failed" "$incomplete"
        printf '"complete": %s, "steps": [' "$complete"
        for i in "${!names[@]}"; do
            printf '%s\n {"step": "%s", "backend": "%s", "result": "%s", "seconds": %d, ' \
                "$sep" "${names[$i]}" "${backends[$i]}" "${results[$i]}" "${seconds[$i]}"
            printf '"estimated_seconds": %d, "note": "%s"}' "$(estimate "${names[$i]}")" \
                "${notes[$i]}"
            sep=,
        done
        printf '\n]}\n'
    } >"$out/summary.json.tmp" && mv "$out/summary.json.tmp" "$out/summary.json"
}

record() {  # name result seconds [note [backend]]: by default the backend the step runs on here
    names+=("$1") results+=("$2") seconds+=("$3") notes+=("${4:-}")
    backends+=("${5:-$(backend "$1")}")
    write_summary
}

backend() {  # name: the backends its collectives run on, as the probe found torch
    if ((rehearse)); then
        echo gloo
        return
    fi
    case $1 in
        gather_nccl) echo "$nccl, then gloo" ;;
        resume) echo "gloo, then gloo + $nccl" ;;  # the first epoch on the CPU
        shared_device_sync_bn_and_replicas) echo gloo ;;
        nccl_timeout_legacy) echo "gloo + ProcessGroupNCCL (TORCH_DIST_USE_NCCL2=0)" ;;
        *) echo "gloo + $nccl" ;;  # train_ddp.py's group on GPUs: gloo for CPU tensors
    esac
}

wanted() {  # name: whether ONLY, if it names any step, names this one
    ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" $1 "* ]]
}

passed() {  # name: whether that step is the last one recorded, and it passed
    ((${#names[@]})) && [[ ${names[-1]} == "$1" && ${results[-1]} == pass ]]
}

# step NAME LIMIT COMMAND...: run it in a session of its own, output in logs/NAME.log, killed with its whole tree
# past LIMIT seconds or the deadline; print the log's tail if it fails.
step() {
    local name=$1 limit=$2 began=$SECONDS status=pass left=$((deadline - SECONDS)) pid cut=false
    local starting=$(($(starts "$1") * START_SECONDS))
    shift 2
    wanted "$name" || return 0
    if ((deadline_skipped)); then  # the plan's order is its priority: no cheaper step jumps the queue
        echo "== $name: skipped, after a step the deadline skipped"
        record "$name" skipped 0 "deadline"
        return
    fi
    if ((left < starting)); then
        echo "== $name: skipped, ${left} s left before the deadline, ${starting} s to start its processes"
        record "$name" skipped 0 "deadline"
        deadline_skipped=1
        return
    fi
    ((limit > left)) && limit=$left cut=true
    echo "== $name"
    setsid "$@" >"$logs/$name.log" 2>&1 </dev/null &
    pid=$! running=$! current=$name current_began=$began
    while kill -0 "$pid" 2>/dev/null && ((SECONDS - began < limit)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        kill_tree "$pid"
        echo "gpu_check.sh: killed after $limit s, with SIGABRT first: the stacks are above" >>"$logs/$name.log"
        status=timeout
    fi
    wait "$pid" || { [[ $status == timeout ]] || status=FAIL; }
    running=
    [[ $status == pass ]] || tail -n 25 "$logs/$name.log"
    if [[ $status == timeout ]] && $cut; then  # the deadline's limit, not the step's own: incomplete
        record "$name" skipped $((SECONDS - began)) deadline
    else
        record "$name" "$status" $((SECONDS - began))
    fi
}

skip() {  # name note [backend]: listed as skipped, with that note, instead of run
    if wanted "$1"; then
        echo "== $1: skipped, $2"
        record "$1" skipped 0 "$2" "${3:-}"
    fi
}

needs_gpu() {  # name: in a rehearsal, listed as skipped instead of run
    ((rehearse)) || return 1
    skip "$1" "needs a GPU" -
}

no_compiler() {  # name: listed as skipped, saying so, where --compile would find no compiler
    [[ -n $compiler_missing ]] || return 1
    skip "$1" "$compiler_missing"
}

one_nccl() {  # name: a step of from_torch_2_15, listed as not applicable instead of run where torch has one NCCL
    ((two_nccls)) && return 1
    if wanted "$1"; then
        echo "== $1: not applicable, torch ${torch_version:-?} has one NCCL backend"
        record "$1" "not applicable" 0 "torch ${torch_version:-?} has one NCCL backend" -
    fi
}

first() {  # command...: a `bash -c` script that runs it, then, if it passed, the script's arguments
    printf '%q ' "$@"
    echo '&& exec "$@"'
}

# verify NAME PYTHON: assertions on the files of the step NAME, if it passed; m(path) reads a metrics file, ck(path)
# a checkpoint, log(name) a step's output. A failed assertion turns the step's result to FAIL. A line `NOTE text`
# that it prints becomes the step's note.
verify() {
    local name=$1
    passed "$name" || return 0
    if timeout 60 $py - "$work" "$logs" "$2" >>"$logs/$name.log" 2>&1 <<'EOF'
import json, math, os, sys
work, logs, check = sys.argv[1:]
m = lambda path: [json.loads(line) for line in open(f"{work}/{path}")]
# torch only where a check reads a checkpoint: its import costs seconds, which the deadline counts.
ck = lambda path: __import__("torch").load(f"{work}/{path}", map_location="cpu", weights_only=True)
log = lambda step: open(f"{logs}/{step}.log").read()
def learned(path, epochs):
    records = m(path)
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1)), records
    assert all(math.isfinite(r["train_loss"]) for r in records), records
    assert records[-1]["train_loss"] < records[0]["train_loss"], records
    assert records[-1]["val_samples"] == val_samples, records
    return records
exec(check)
print("verified")
EOF
    then
        # Without what JSON cannot hold unescaped: quotes, backslashes, control characters.
        notes[-1]=$(grep '^NOTE ' "$logs/$name.log" | tail -n 1 | cut -c6- | tr -d '"\\\000-\037')
    else
        tail -n 8 "$logs/$name.log"
        results[-1]=FAIL
    fi
    write_summary
}

finish() {
    local status=$? i
    # timeout sends its TERM twice, to the script and then to its whole group: a second one must not cut the clean-up
    # short, nor kill what it starts (sleep inherits the ignoring; the process-tree scan ignores it itself).
    trap '' TERM INT
    if [[ -n $running ]]; then
        kill_tree "$running"
        record "$current" stopped $((SECONDS - current_began))
    fi
    finished=true
    write_summary
    echo
    printf '| step | backend | result | seconds | estimated on an H200 (process starts) | note |\n'
    printf '|---|---|---|---|---|---|\n'
    for i in "${!names[@]}"; do
        printf '| %s | %s | %s | %s | %s (%s) | %s |\n' "${names[$i]}" "${backends[$i]}" \
            "${results[$i]}" "${seconds[$i]}" "$(estimate "${names[$i]}")" \
            "$(starts "${names[$i]}")" "${notes[$i]}"
    done
    ((status == 0)) || failed=$((failed > 0 ? failed : 1))
    tar -czf "$out/step_logs.tar.gz" -C "$logs" . && rm -r "$logs"
    rm -rf "$work"
    echo "$failed step(s) failed, $incomplete skipped by the deadline, $SECONDS s; logs in $out"
    exit $((failed > 0 ? 1 : incomplete > 0 ? 2 : 0))
}
trap finish EXIT
trap 'trap "" TERM INT; echo "gpu_check.sh: stopped by a signal"; exit 1' TERM INT

# DataLoader workers for batches of $1 MB: one for each core but two (one for the training
# process, one spare), as many as /dev/shm holds (each worker has up to 2 batches there,
# DataLoader's prefetch_factor, and the training process holds one more), down to none.
shm_free_mb=$(timeout 10 df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
workers_for() {
    local spare=$((cores - 2)) fit=$(((${shm_free_mb:-0} / $1 - 1) / 2))
    ((fit > 0)) || fit=0
    echo $((fit < spare ? fit : spare))
}
if ((rehearse)); then
    small=(--arch resnet18 --image-size 32 --train-samples 256 --val-samples 32 --batch-size 16 --workers 2
           --epochs 2 --log-every 4)
    val=32 on="1 x cpu (gloo)" long=(--train-samples 2048) fp16=(--train-samples 64)  # fp16 on a CPU is slow
    headline_workers=2
    headline=(--arch resnet18 --image-size 32 --batch-size 16 --train-samples 256 --val-samples 32 --log-every 8
              --workers "$headline_workers")
else
    # 2 workers x 3 batches of 0.8 MB fit in any /dev/shm.
    small=(--arch resnet18 --image-size 64 --train-samples 2048 --val-samples 256 --batch-size 64 --workers 2
           --epochs 2 --log-every 8)
    val=256 on="1 x cuda (nccl)" long=(--train-samples 16384) fp16=()
    # ImageNet's size: 60 steps of 256 images (37 MB of uint8 a batch), the first 10 the warm-up.
    headline_workers=$(workers_for 37)
    headline=(--arch resnet50 --image-size 224 --batch-size 256 --amp bf16 --channels-last --train-samples 15360
              --val-samples 2560 --log-every 10 --workers "$headline_workers")
fi
# Each process that imports torch takes 10 to 15 s to start here. So one rank runs as plain python,
# without a launcher (train_ddp.py's group on a store in memory), where the launcher is not what the
# step proves; torchrun, which is one more such process, runs nccl_timeout (its settings), the two
# ranks, and --compile (under --collective-timeout). test_gather.py's one rank gets env://'s
# variables, as torchrun sets them, and a store of its own on a port the system picks.
torchrun=($py -m torch.distributed.run --standalone)
one_rank=(env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=0 "$py")
train=($py train_ddp.py "${small[@]}")
checked=($py tools/check_syncs.py "${small[@]}")  # train_ddp.py, watched for host syncs
learned() {  # name [checked]: 2 epochs of falling loss over every val image in its metrics file; and no host sync
    verify "$1" "val_samples = $val; learned('$1.jsonl', 2)
assert '${2:-}' != 'checked' or 'rank 0: 0 host waits between log lines' in log('$1'), 'host syncs'"
}

date -u
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "$versions"
timeout 10 df -h /dev/shm
torch_version_re='torch ([0-9]+)\.([0-9]+)'
two_nccls=0 torch_version= nccl=ProcessGroupNCCL
if [[ $versions =~ $torch_version_re ]]; then
    torch_version=${BASH_REMATCH[1]}.${BASH_REMATCH[2]}
    ((BASH_REMATCH[1] * 100 + BASH_REMATCH[2] >= 215)) && two_nccls=1 nccl=ProcessGroupNCCL2
fi
started=${probes_and_checks[0]} total=$((probes_and_checks[0] * START_SECONDS + probes_and_checks[1])) steps=0
for ((i = 0; i < ${#plan[@]}; i += 3)); do
    if ((two_nccls)) || [[ " ${from_torch_2_15[*]} " != *" ${plan[i]} "* ]]; then
        started=$((started + plan[i + 1])) total=$((total + $(estimate "${plan[i]}"))) steps=$((steps + 1))
    fi
done
echo "gpu_check.sh: $steps steps for torch ${torch_version:-?}, estimated $total s in all on an H200" \
    "($started process starts of $START_SECONDS s); deadline ${DEADLINE:-540} s"
# --compile builds kernels with a compiler that it finds as torch does: on CUDA, Triton's launcher
# takes $CC, else gcc, else clang (triton/runtime/build.py); on the CPU, Inductor takes $CXX, else
# g++ (torch/_inductor/config.py, cpp.cxx). Without one, every rank would fail at its first step,
# deep in Inductor's traceback, and the step would be spent on what the machine lacks.
compiler_missing=
if ((rehearse)); then
    compiler=$(command -v -- "${CXX-g++}") ||
        compiler_missing="no C++ compiler: Inductor takes CXX, else g++"
elif [[ -v CC ]]; then
    compiler=$(command -v -- "$CC") || compiler_missing="no C compiler: Triton takes CC, not found"
else
    compiler=$(command -v gcc || command -v clang) ||
        compiler_missing="no C compiler: Triton takes CC, else gcc, else clang"
fi
echo "--compile's compiler: ${compiler:-none, $compiler_missing}"

# test_gather.py over NCCL, then over gloo with CUDA tensors, which gather_utils moves through the
# host and copies back to the GPU (a world of one with a process group moves its data too).
nccl_first=$(first "${one_rank[@]}" test_gather.py --backend nccl)
gloo_cuda=("${one_rank[@]}" test_gather.py --backend gloo --device cuda)
needs_gpu gather_nccl || step gather_nccl 150 bash -c "$nccl_first" _ "${gloo_cuda[@]}"
needs_gpu gather_mixed_group ||  # test_gather.py's MIXED_GROUP_CHECKS
    step gather_mixed_group 90 "${one_rank[@]}" test_gather.py --backend cpu:gloo,cuda:nccl

# The headline: train_ddp.py itself at ImageNet's size, its images/s and share of time waiting for data, with no
# host-device sync between log lines (check_syncs.py).
step headline 150 $py tools/check_syncs.py "${headline[@]}" --epochs 1 \
    --checkpoint-dir "$work/headline" --metrics-file "$work/headline.jsonl"
# Without workers (a container's 64 MB /dev/shm holds none) the training process makes every batch
# itself: its images/s is then this host's synthetic-data generation as much as the GPU's speed.
no_workers=
if ((headline_workers == 0)); then
    no_workers="; 0 DataLoader workers (/dev/shm: ${shm_free_mb:-?} MB free; cores: $cores):"
    no_workers+=" img/s bounded by this host making the synthetic data, not by the GPU"
fi
verify headline "r, = m('headline.jsonl'); assert 'rank 0: 0 host waits between log lines' in log('headline')
figure = f\"{r['images_per_sec']:.0f} img/s, waiting for data {r['data_wait']:.0%}, no host sync\"
print('NOTE', figure + '$no_workers')"

# A collective past --collective-timeout on NCCL: what a user sees when a rank hangs. One GPU has no
# second rank to hang, so the GPU itself is kept busy (torch.cuda._sleep, 20 s) past the timeout
# (5 s) before an all-reduce that waits for it. Expected, with train_ddp.py's settings
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=2; the recorder's file in the folder the script is given, where
# the check looks for it), as read in torch's sources, on each backend:
# - ProcessGroupNCCL (before 2.15; 2.15 with TORCH_DIST_USE_NCCL2=0): its watchdog, every 100 ms,
#   logs "Watchdog caught collective operation timeout: WorkNCCL(...)", writes a dump signal to the
#   store (every rank's monitor dumps its recorder: this rank's last collectives), and aborts NCCL
#   4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC later (60 s by default, 4 s here). Waiting on the
#   timed-out work raises DistBackendError; the next collective after the abort, DistBackendError
#   "NCCL communicator was aborted on rank 0".
# - ProcessGroupNCCL2 (2.15's nccl): its watchdog, every second, logs "Operation timed out after N
#   ms", dumps this rank's recorder at once (each rank dumps its own when its own watchdog fails;
#   nothing goes through the store), then aborts NCCL: no wait. Waiting on the timed-out work raises
#   DistBackendError; the next collective, RuntimeError "NCCL operation timed out".
# A dump attempt waits up to TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC on both (1 s here; a second attempt
# leaves out the stacks). In a hang the one line comes with the next collective after the abort:
# about 60 s after the timeout on the old backend, a second or so (and the dump) on nccl2. Here the
# host waits for the sleep first, so on both it comes soon after the sleep: process_group() ends the
# run with its one line, naming the recorder's file, and exit 1; destroy_process_group() does not
# hang. The script prints the NCCL class it ran on, which the check compares with the step's.
cat >"$work/nccl_timeout.py" <<'EOF'
import argparse, sys, time, torch, torch.distributed as dist, train_ddp
def cycles_per_second():  # torch.cuda.clock_rate() needs pynvml, which torch does not install
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(10**8); end.record(); end.synchronize()
    return 10**8 / (start.elapsed_time(end) / 1000)
args = argparse.Namespace(backend="nccl", init_timeout=60, collective_timeout=5, local_rank=0,
                          checkpoint_dir=sys.argv[1])
device = train_ddp.setup_device(args)
began = time.monotonic()
with train_ddp.process_group(args, device):
    print("NCCL backend", type(dist.group.WORLD._get_backend(device)).__name__, flush=True)
    x = torch.ones(1, device=device)
    torch.cuda._sleep(int(20 * cycles_per_second()))  # about 20 s of the GPU's time
    dist.all_reduce(x)
    print(f"all_reduce queued; the host reads its result at {time.monotonic() - began:.1f} s", flush=True)
    print(f"read {x.item()} at {time.monotonic() - began:.1f} s", flush=True)
print("process_group() returned: no error", flush=True)
EOF
exits_1='"$@"; code=$?; echo "gpu_check.sh: exit code $code"; ((code == 1))'
# Without torchfrtrace on PATH the line names the rank's file alone, as on every torch (2.3 has no such tool; where
# torch has it, the line adds a hint to it): the folders that hold it are left out of the step's PATH, and torchrun
# runs as python's own path, since a pyenv shim would put such a folder back.
IFS=: read -ra path_dirs <<<"$PATH"
no_frtrace=$(for dir in "${path_dirs[@]}"; do [[ -x $dir/torchfrtrace ]] || printf '%s:' "$dir"; done)
timed_out=(env PATH="${no_frtrace%:}" TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1000 "$BASH" -c "$exits_1" _
           "$(timeout 60 $py -c 'import sys; print(sys.executable)')" -m torch.distributed.run --standalone
           --nproc-per-node 1 "$work/nccl_timeout.py")
# timed_out_verified NAME CLASS: the step ran on that NCCL class, and the one line names the
# recorder's file, which is there, in the step's folder.
timed_out_verified() {
    verify "$1" "assert 'NCCL backend $2' in log('$1').splitlines(), 'not on $2'
line = next(l for l in log('$1').splitlines() if 'error: rank 0: a collective' in l)
trace = line.rpartition('; its last collectives: ')[2]
assert trace != line and 'torchfrtrace' not in line, 'not one trace file named: ' + line
assert os.path.realpath(os.path.dirname(trace)) == os.path.realpath(f'{work}/$1'), trace
assert os.path.basename(trace) == 'nccl_trace_rank_0' and os.path.getsize(trace) > 0, trace
print('NOTE', f'trace of {os.path.getsize(trace)} bytes; ' + line[line.index('look for'):][:120])"
}
needs_gpu nccl_timeout || step nccl_timeout 90 "${timed_out[@]}" "$work/nccl_timeout"
timed_out_verified nccl_timeout "$nccl"

# train_ddp.py on NCCL in fp16, ResNet-18 at 64 px under check_syncs.py: the seed's two speed tips
# together, autocast with the GradScaler, and gradients compressed to fp16 by the hook. Its first
# steps may overflow or not, so a few steps of train_ddp.py's own model, optimizer (fused SGD on
# CUDA) and GradScaler come first, the first one's loss made inf: the GradScaler skips it, the
# momentum stays zero (fused SGD would leave garbage without build_optimizer's zeros), and the first
# step taken gives the momentum and weights of plain SGD.
cat >"$work/fp16_first_step.py" <<'EOF'
import sys, torch, torch.nn.functional as F, train_ddp
args = train_ddp.parse_args(["--arch", "resnet18", "--image-size", "32", "--amp", "fp16", "--channels-last",
                             "--checkpoint-dir", sys.argv[1]])
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = train_ddp.build_model(args, None)[0].to(device, memory_format=train_ddp.memory_format(args))
optimizer, scaler = train_ddp.build_optimizer(model, args)
(group,) = optimizer.param_groups
assert group["fused"] == (device.type == "cuda"), group["fused"]
images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
images, labels = images.to(device, memory_format=torch.channels_last), torch.arange(8, device=device) % 10
def step(loss_factor):  # as train_one_epoch steps: whether skipped, and the weights and gradients it started from
    with train_ddp.amp_context(args, device):
        loss = F.cross_entropy(model(images), labels)
    scaler.scale(loss * loss_factor).backward()
    scale = scaler.get_scale()
    start = [(p.detach().clone(), p.grad / scale) for p in group["params"]]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scaler.get_scale() < scale, start
def momentum_is_zero():
    for p in group["params"]:
        buffer = optimizer.state[p].get("momentum_buffer")
        assert buffer is not None and buffer.stride() == p.stride() and not buffer.any(), "momentum not zero"
assert step(float("inf"))[0], "a step with an inf loss was taken"
momentum_is_zero()
for skipped_after in range(10):  # the GradScaler's first scale may overflow fp16 too
    skipped, start = step(1)
    if not skipped:
        break
    momentum_is_zero()
assert not skipped, "10 steps skipped after the first"
plain_weights = [weight.requires_grad_() for weight, _ in start]
for weight, (_, grad) in zip(plain_weights, start):
    weight.grad = grad
plain = torch.optim.SGD(plain_weights, lr=group["lr"], momentum=group["momentum"],
                        weight_decay=group["weight_decay"], foreach=False)
plain.step()
for p, weight in zip(group["params"], plain_weights):
    torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], plain.state[weight]["momentum_buffer"])
    torch.testing.assert_close(p.detach(), weight.detach())
print(f"NOTE {'fused' if group['fused'] else 'unfused'} SGD: an inf first step skipped, momentum 0 after it; "
      f"{skipped_after} more skipped; the next as plain SGD", flush=True)
EOF
step train_fp16_hook_fp16 90 bash -c "$(first "$py" "$work/fp16_first_step.py" "$work/fp16_first_step")" _ \
    "${checked[@]}" "${fp16[@]}" --amp fp16 --comm-hook fp16 --checkpoint-dir "$work/fp16" \
    --metrics-file "$work/train_fp16_hook_fp16.jsonl"
learned train_fp16_hook_fp16 checked

# A resume across devices and memory formats: 1 epoch on the CPU (no CUDA visible: gloo, unfused SGD, contiguous
# momentum), resumed on the GPU with --channels-last, where the fused CUDA kernel refuses momentum in a layout other
# than its parameter's. It trains the second epoch, and saves channels-last momentum for every parameter.
cpu_epoch=(env CUDA_VISIBLE_DEVICES= "${train[@]}" --train-samples 256 --val-samples 64 --epochs 1
           --checkpoint-dir "$work/resume" --metrics-file "$work/resume.jsonl")
step resume 90 bash -c "$(first "${cpu_epoch[@]}")" _ "${train[@]}" --channels-last --resume "$work/resume/last.pt" \
    --checkpoint-dir "$work/resume" --metrics-file "$work/resume.jsonl"
verify resume "val_samples = $val; torch = __import__('torch'); text = log('resume')
assert 'on 1 x cpu (gloo)' in text and '$on' in text and 'at epoch 2 step 0' in text, 'no CPU checkpoint resumed'
records = m('resume.jsonl')
assert [r['epoch'] for r in records] == [1, 2] and all(math.isfinite(r['train_loss']) for r in records), records
assert records[-1]['val_samples'] == val_samples, records
c = ck('resume/last.pt'); (group,) = c['optimizer']['param_groups']
assert (c['epoch'], c['step'], group['fused']) == (2, 0, '$on' != '1 x cpu (gloo)'), (c['epoch'], c['step'], group)
buffers = [state['momentum_buffer'] for state in c['optimizer']['state'].values()]
assert len(buffers) == len(group['params']) and all(b.isfinite().all() for b in buffers), 'momentum missing or inf'
assert all(b.is_contiguous(memory_format=torch.channels_last) for b in buffers if b.dim() == 4), 'not channels-last'
print('NOTE', f\"a CPU checkpoint resumed on $on, channels-last: epoch 2 train_loss {records[-1]['train_loss']:.3f}\")"

# Two ranks on the one GPU over gloo, through train_ddp.py's wrap_ddp with --sync-bn: 3 SGD steps of
# 8 images each must give the weights and batch-norm statistics of one process stepping on all 16
# with plain batch norm, on both ranks, so that the replicas agree too. Unsynchronized statistics
# would differ. The process group ends as train_ddp.py's does, the model freed first (a
# model alive at destroy_process_group() was the recipe of the exit hang of torch < 2.14).
# nn.SyncBatchNorm runs on GPUs only, and train_ddp.py's --sync-bn with it: a rehearsal skips this.
cat >"$work/shared_device.py" <<'EOF'
import argparse, os, torch, torch.nn.functional as F, torchvision, train_ddp
args = argparse.Namespace(sync_bn=True, channels_last=False, comm_hook="none", compile=False, backend="gloo",
                          init_timeout=60, collective_timeout=120, checkpoint_dir=os.path.dirname(__file__))
def trained(model, x, y, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # at 0.2, 3 steps on 8 images already diverge
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return model
def main():
    rank, device = train_ddp.dist.get_rank(), torch.device("cuda")
    torch.backends.cudnn.allow_tf32 = False  # batches of 8 and of 16 may take kernels that round TF32 differently
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    torch.manual_seed(0)
    ddp, _ = train_ddp.wrap_ddp(torchvision.models.resnet18(num_classes=10), args, device)
    mine = slice(8 * rank, 8 * rank + 8)
    trained(ddp, images[mine], labels[mine], device)
    torch.manual_seed(0)
    single = trained(torchvision.models.resnet18(num_classes=10).to(device), images, labels, device).state_dict()
    for key, value in ddp.module.state_dict().items():
        torch.testing.assert_close(value.double(), single[key].double(), rtol=1e-3, atol=1e-4, msg=key)
    print(f"rank {rank}: weights and statistics equal one process's")
with train_ddp.process_group(args, torch.device("cpu")):  # gloo, whatever the tensors' device
    main()
EOF
needs_gpu shared_device_sync_bn_and_replicas ||
    step shared_device_sync_bn_and_replicas 90 "${torchrun[@]}" --nproc-per-node 2 "$work/shared_device.py"

# SIGTERM mid-epoch to a one-process run that also saves every 10 steps (the copy from the GPU, the writer thread):
# it saves last.pt at the step it reached and exits 75: stopped, saved. ($0 of the inline script is the step's log.)
sigterm_after_step_20='"$@" & for _ in $(seq 900); do grep -q "step 20/" "$0" && break; sleep 0.1; done
kill -TERM $!; wait $! || [ $? = 75 ]'
step sigterm 120 bash -c "$sigterm_after_step_20" "$logs/sigterm.log" "${train[@]}" "${long[@]}" \
    --epochs 1 --log-every 1 --save-every 10 --checkpoint-dir "$work/sigterm"
verify sigterm "assert 'continue with --resume' in log('sigterm'), 'no checkpoint line'
c = ck('sigterm/last.pt'); assert c['epoch'] == 0 and 20 <= c['step'] < 128, (c['epoch'], c['step'])"

# torch 2.15 and later: the collective past its timeout again on the old ProcessGroupNCCL, which
# TORCH_DIST_USE_NCCL2=0 selects.
one_nccl nccl_timeout_legacy || needs_gpu nccl_timeout_legacy ||
    step nccl_timeout_legacy 90 env TORCH_DIST_USE_NCCL2=0 "${timed_out[@]}" "$work/nccl_timeout_legacy"
timed_out_verified nccl_timeout_legacy ProcessGroupNCCL

# --compile, last: the costliest for what it adds; under torchrun, its first two steps wait for
# the compilation under a longer timeout (COMPILE_TIMEOUT), then --collective-timeout holds.
no_compiler compile ||
    step compile 180 "${torchrun[@]}" --nproc-per-node 1 train_ddp.py "${small[@]}" --compile \
        --checkpoint-dir "$work/compile" --metrics-file "$work/compile.jsonl"
learned compile
verify compile "assert 'compiled (the first step compiles' in log('compile')"
exit 0  # finish(), the EXIT trap, reports and sets the exit code
