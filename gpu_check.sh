#!/usr/bin/env bash
# The GPU proof in one try, on one CUDA machine, with the python3 it finds (torch 2.3 or later with torchvision;
# nothing installed), inside a deadline. Most valuable first: the gather tests over NCCL and over gloo with CUDA
# tensors; two ranks sharing the GPU over gloo (SyncBN statistics and DDP replicas against one process);
# train_ddp.py on NCCL: fp32, resume, --evaluate, SIGTERM mid-epoch and its resume; bf16 + channels-last, fp16,
# each hook, SyncBN, --compile, a fine-tune from --weights; then ResNet-50 speed at 224 px, on synthetic batches
# already on the GPU and through the DataLoader from JPEG photographs (is the GPU waiting for its input?).
#
#   bash gpu_check.sh                 # on the GPU machine: DEADLINE seconds in all (default 480)
#   DEADLINE=600 bash gpu_check.sh
#   bash gpu_check.sh --rehearse      # without a GPU: the same steps and checks on the CPU at toy sizes (the
#                                     # steps that need CUDA are skipped), to prove the script itself and time it
#
# Every step runs whatever failed before it, under a time limit of its own (past it, its whole process tree is
# killed), and asserts its result. A step starts only if the deadline leaves it 20 s; the rest are listed as
# skipped. Out ($OUT, else a new folder it names): gpu_check.log; summary.json, rewritten after every step;
# logs/NAME.log, written as each step runs and packed into step_logs.tar.gz at the end (also on SIGTERM).
# The exit code is 1 if any step failed or timed out.
#
# What one GPU cannot show: NCCL between ranks. NCCL refuses two ranks on one GPU, so its multi-rank paths
# (gather_utils' uneven all-gather, the header exchange between ranks, DDP's all-reduce, SyncBN over NCCL) run
# only at world size 1 here; two ranks share the GPU over gloo instead.
set -uo pipefail
cd "$(dirname "$0")"
rehearse=0
if [[ ${1:-} == --rehearse ]]; then rehearse=1; fi
out=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
logs=$out/logs
work=$(mktemp -d /tmp/gpu_check_work.XXXXXX)  # checkpoints and data: not copied back
mkdir -p "$logs"
exec > >(tee "$out/gpu_check.log") 2>&1
deadline=$((SECONDS + ${DEADLINE:-480}))
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
py=python3
names=() results=() seconds=() notes=()
running= current= current_began=

# The pid of the step in flight, and every process under it (torchrun starts its workers in sessions of their own).
tree() {
    timeout 10 $py - "$1" <<'EOF'
import os, sys
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

kill_tree() {  # stopped first, so that none of them can start another or be reparented while the rest die
    local pids
    pids=$(tree "$1")
    kill -STOP $pids 2>/dev/null
    kill -KILL $pids $(tree "$1") 2>/dev/null
}

write_summary() {  # written whole, then renamed: a kill leaves the last complete one
    local i sep=
    {
        printf '{"deadline_seconds": %d, "rehearsal": %s, "steps": [' "${DEADLINE:-480}" \
            "$( ((rehearse)) && echo true || echo false)"
        for i in "${!names[@]}"; do
            printf '%s\n {"step": "%s", "result": "%s", "seconds": %d, "note": "%s"}' "$sep" "${names[$i]}" \
                "${results[$i]}" "${seconds[$i]}" "${notes[$i]}"
            sep=,
        done
        printf '\n]}\n'
    } >"$out/summary.json.tmp" && mv "$out/summary.json.tmp" "$out/summary.json"
}

record() {  # name result seconds [note]
    names+=("$1") results+=("$2") seconds+=("$3") notes+=("${4:-}")
    write_summary
}

# step NAME LIMIT COMMAND...: run it in a session of its own, output in logs/NAME.log, killed with its whole tree
# past LIMIT seconds or the deadline; print the log's tail if it fails.
step() {
    local name=$1 limit=$2 began=$SECONDS status=pass left=$((deadline - SECONDS)) pid
    shift 2
    if ((left < 20)); then
        echo "== $name: skipped, ${left} s left before the deadline"
        record "$name" skipped 0 "deadline"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name"
    setsid "$@" >"$logs/$name.log" 2>&1 </dev/null &
    pid=$! running=$! current=$name current_began=$began
    while kill -0 "$pid" 2>/dev/null && ((SECONDS - began < limit)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
        kill_tree "$pid"
        echo "gpu_check.sh: killed after $limit s" >>"$logs/$name.log"
        status=timeout
    fi
    wait "$pid" || { [[ $status == timeout ]] || status=FAIL; }
    running=
    [[ $status == pass ]] || tail -n 25 "$logs/$name.log"
    record "$name" "$status" $((SECONDS - began))
}

needs_gpu() {  # name: record it as skipped in a rehearsal
    ((rehearse)) || return 1
    echo "== $1: skipped, needs a GPU"
    record "$1" skipped 0 "needs a GPU"
}

# verify NAME PYTHON: assertions on the files of the step NAME; m(path) reads a metrics file, ck(path) a
# checkpoint, log(name) a step's output. A failed assertion turns the step's result to FAIL.
verify() {
    local name=$1 i
    [[ ${results[-1]} == pass && ${names[-1]} == "$name" ]] || return 0
    if ! timeout 60 $py - "$work" "$logs" "$2" >>"$logs/$name.log" 2>&1 <<'EOF'
import json, math, sys, torch
work, logs, check = sys.argv[1:]
m = lambda path: [json.loads(line) for line in open(f"{work}/{path}")]
ck = lambda path: torch.load(f"{work}/{path}", map_location="cpu", weights_only=True)
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
        tail -n 8 "$logs/$name.log"
        results[-1]=FAIL
        write_summary
    fi
}

finish() {
    local status=$?
    if [[ -n $running ]]; then
        kill_tree "$running"
        record "$current" stopped $((SECONDS - current_began))
    fi
    echo
    printf '| step | result | seconds | note |\n|---|---|---|---|\n'
    local i failed=0
    for i in "${!names[@]}"; do
        printf '| %s | %s | %s | %s |\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}" "${notes[$i]}"
        [[ ${results[$i]} == pass || ${results[$i]} == skipped ]] || failed=$((failed + 1))
    done
    ((status == 0)) || failed=$((failed > 0 ? failed : 1))
    tar -czf "$out/step_logs.tar.gz" -C "$logs" . && rm -r "$logs"
    rm -rf "$work"
    echo "$failed step(s) failed, $((SECONDS)) s; logs in $out"
    exit $((failed > 0))
}
trap finish EXIT
trap 'echo "gpu_check.sh: stopped by a signal"; exit 1' TERM INT

if ((rehearse)); then
    small=(--arch resnet18 --image-size 32 --train-samples 256 --val-samples 32 --batch-size 16 --workers 2
           --epochs 2 --log-every 4)
    val=32 on="1 x cpu (gloo)" long=(--train-samples 2048) fp16=(--train-samples 64)  # fp16 on a CPU is slow
    bench=(bench_train.py --device cpu --nproc 1 --image-size 32 --batches 16 --steps 3 --warmup 2 --repeats 1)
    photos=(--images 96 --val-images 16) real=(--arch resnet18 --image-size 64 --batch-size 16 --workers 2)
else
    # DataLoader workers pass batches through /dev/shm: 2 workers x 3 batches of 0.8 MB fit in any.
    small=(--arch resnet18 --image-size 64 --train-samples 2048 --val-samples 256 --batch-size 64 --workers 2
           --epochs 2 --log-every 8)
    val=256 on="1 x cuda (nccl)" long=(--train-samples 16384) fp16=()
    bench=(bench_train.py --device cuda --nproc 1 --image-size 224 --batches 256 --steps 30 --warmup 15 --repeats 1)
    # JPEGs at ImageNet's size, a DataLoader worker for each core but two (one for this process, one spare), as
    # many as /dev/shm holds: each prefetches 2 uint8 batches of 37 MB (and the process holds one).
    workers=$(($(nproc) - 2)) shm_workers=$(( ($(df -Pm /dev/shm | awk 'NR == 2 {print $4}') / 37 - 1) / 2 ))
    ((workers > shm_workers)) && workers=$shm_workers
    photos=(--images 4096 --val-images 512)
    real=(--arch resnet50 --image-size 224 --batch-size 256 --workers $((workers > 1 ? workers : 1)) --amp bf16
          --channels-last)
fi
train=($py -m torch.distributed.run --standalone --nproc-per-node 1 train_ddp.py "${small[@]}")
learned() {  # name: the step's metrics file shows 2 epochs of falling loss over every val image
    verify "$1" "val_samples = $val; learned('$1.jsonl', 2)"
}

date -u
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 60 $py -c 'import sys, torch, torchvision
cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__,
      "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
      "GPUs", torch.cuda.device_count(), "cores", len(__import__("os").sched_getaffinity(0)))'
df -h /dev/shm

needs_gpu gather_nccl ||
    step gather_nccl 150 $py -m torch.distributed.run --standalone --nproc-per-node 1 test_gather.py --backend nccl
needs_gpu gather_gloo_cuda ||
    step gather_gloo_cuda 150 $py -m torch.distributed.run --standalone --nproc-per-node 2 test_gather.py \
        --backend gloo --device cuda

# Two ranks on the one device over gloo, through train_ddp.py's wrap_ddp with --sync-bn: 3 SGD steps of 8 images
# each must give the weights and batch-norm statistics of one process stepping on all 16 with plain batch norm,
# and replicas that agree (replica_checksums raises if not). Unsynchronized statistics would differ.
cat >"$work/shared_device.py" <<'EOF'
import argparse, torch, torch.distributed as dist, torch.nn.functional as F, torchvision, train_ddp
dist.init_process_group("gloo")
rank, device = dist.get_rank(), torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
torch.backends.cudnn.allow_tf32 = False  # batches of 8 and of 16 may take kernels that round TF32 differently
generator = torch.Generator().manual_seed(1)
images, labels = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
def trained(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # at 0.2, 3 steps on 8 images already diverge
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return model
torch.manual_seed(0)
args = argparse.Namespace(sync_bn=True, channels_last=False, comm_hook="none", compile=False)
ddp = train_ddp.wrap_ddp(torchvision.models.resnet18(num_classes=10), args, device, warmup_steps=0)
mine = slice(8 * rank, 8 * rank + 8)
checksums = train_ddp.replica_checksums(trained(ddp, images[mine], labels[mine]))
torch.manual_seed(0)
single = trained(torchvision.models.resnet18(num_classes=10).to(device), images, labels).state_dict()
for key, value in ddp.module.state_dict().items():
    torch.testing.assert_close(value.double(), single[key].double(), rtol=1e-3, atol=1e-4, msg=key)
print(f"rank {rank}: replicas {checksums} agree; weights and statistics equal one process's")
dist.destroy_process_group()
EOF
step shared_device_sync_bn_and_replicas 120 $py -m torch.distributed.run --standalone --nproc-per-node 2 \
    "$work/shared_device.py"

step train_fp32 150 "${train[@]}" --checkpoint-dir "$work/fp32" --metrics-file "$work/train_fp32.jsonl"
learned train_fp32
verify train_fp32 "assert '$on' in log('train_fp32')"
step resume 120 "${train[@]}" --epochs 3 --resume "$work/fp32/last.pt" --checkpoint-dir "$work/fp32" \
    --metrics-file "$work/train_fp32.jsonl"
verify resume "val_samples = $val; assert 'at epoch 3 step 0' in log('resume'); learned('train_fp32.jsonl', 3)
assert ck('fp32/last.pt')['epoch'] == 3"
step evaluate 90 "${train[@]}" --evaluate --resume "$work/fp32/last.pt" --metrics-file "$work/evaluate.jsonl"
verify evaluate "e, = m('evaluate.jsonl'); t = m('train_fp32.jsonl')[-1]
assert e['epoch'] == 3 and e['val_samples'] == $val, e
assert abs(e['val_acc1'] - t['val_acc1']) <= 100 / $val, (e, t)  # cudnn may pick other kernels: one image at most"

# SIGTERM mid-epoch to a one-process run: it saves last.pt at the step it reached and exits 0; the resumed run
# goes on from the next step. ($0 of the inline script is the step's log.)
sigterm_after_step_20='"$@" & for _ in $(seq 900); do grep -q "step 20/" "$0" && break; sleep 0.1; done
kill -TERM $!; wait $!'
step sigterm 120 bash -c "$sigterm_after_step_20" "$logs/sigterm.log" $py train_ddp.py "${small[@]}" "${long[@]}" \
    --epochs 1 --log-every 1 --checkpoint-dir "$work/sigterm"
verify sigterm "assert 'continue with --resume' in log('sigterm'), 'no checkpoint line'
c = ck('sigterm/last.pt'); assert c['epoch'] == 0 and 20 <= c['step'] < 128, (c['epoch'], c['step'])"
step sigterm_resume 120 "${train[@]}" "${long[@]}" --epochs 1 --checkpoint-dir "$work/sigterm" \
    --resume "$work/sigterm/last.pt"
verify sigterm_resume "import re; stopped = re.search(r'SIGTERM at epoch 1 step (\d+)/', log('sigterm'))[1]
assert f'at epoch 1 step {stopped}' in log('sigterm_resume') and ck('sigterm/last.pt')['epoch'] == 1"

step train_bf16_channels_last 120 "${train[@]}" --amp bf16 --channels-last --checkpoint-dir "$work/bf16" \
    --metrics-file "$work/train_bf16_channels_last.jsonl"
learned train_bf16_channels_last
step train_fp16 120 "${train[@]}" "${fp16[@]}" --amp fp16 --checkpoint-dir "$work/fp16" \
    --metrics-file "$work/train_fp16.jsonl"
learned train_fp16
verify train_fp16 "s = ck('fp16/last.pt')['scaler']; assert 0 < s['scale'] <= 2**16, s"
for hook in fp16 bf16 powersgd; do
    step "hook_$hook" 120 "${train[@]}" --comm-hook "$hook" --warmup-epochs 0.25 --checkpoint-dir "$work/hook_$hook" \
        --metrics-file "$work/hook_$hook.jsonl"
    learned "hook_$hook"
done
step sync_bn 120 "${train[@]}" --sync-bn --checkpoint-dir "$work/sync_bn" --metrics-file "$work/sync_bn.jsonl"
learned sync_bn
step compile 180 "${train[@]}" --compile --checkpoint-dir "$work/compile" --metrics-file "$work/compile.jsonl"
learned compile
verify compile "assert 'compiled (the first step compiles' in log('compile')"
# A fine-tune: train_fp32's checkpoint (10 classes) into a model of 4, whose classifier is new.
step weights 120 "${train[@]}" --weights "$work/fp32/last.pt" --num-classes 4 --checkpoint-dir "$work/weights" \
    --metrics-file "$work/weights.jsonl"
learned weights
verify weights "assert f'from {work}/fp32/last.pt (new fc)' in log('weights'), 'no new classifier'"

# Speed: ResNet-50, synthetic batches already on the device, one process without and with DDP.
speed() {  # name, bench_train.py flags: the step, with its images/s as the note
    step "$1" 150 $py "${bench[@]}" --configs single "ddp default" "${@:2}"
    [[ ${results[-1]} == pass ]] || return 0
    notes[-1]=$(grep '^| [0-9]' "$logs/$1.log" |
        awk -F'|' '{c = $3; v = $4; gsub(/^ +| +$/, "", c); gsub(/ *\(.*| /, "", v)
                    printf "%s%s %s img/s", s, c, v; s = ", "}')
    write_summary
}
speed speed_fp32 --amp off
speed speed_bf16_channels_last --amp bf16 --channels-last

# Real images: the photographs through train_ddp.py's input pipeline, against the synthetic batches above.
step photographs 90 $py bench_data.py --write-folder "$work/photos" "${photos[@]}"
step real_data 180 $py -m torch.distributed.run --standalone --nproc-per-node 1 train_ddp.py --data "$work/photos" \
    "${real[@]}" --epochs 2 --log-every 4 --checkpoint-dir "$work/real" --metrics-file "$work/real_data.jsonl"
verify real_data "r = m('real_data.jsonl')[-1]; assert r['images_per_sec'] > 0 and 0 <= r['data_wait'] < 1, r
print('NOTE', f\"{r['images_per_sec']:.0f} img/s, waiting for data {r['data_wait']:.0%}\")"
[[ ${results[-1]} == pass ]] && notes[-1]=$(grep -o 'NOTE .*' "$logs/real_data.log" | cut -c6-) && write_summary
exit 0  # finish(), the EXIT trap, reports and sets the exit code
