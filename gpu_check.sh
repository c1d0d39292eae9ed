#!/usr/bin/env bash
# One-shot proof on one CUDA machine, in about 5 minutes, with the python3 it finds (nothing
# installed): the gather tests over NCCL and over gloo with CUDA tensors; train_ddp.py on NCCL
# with each precision, hook and SyncBN, DataLoader workers, resume, --evaluate and SIGTERM; then
# ResNet-50 speed at 224 px. Every step runs, whatever failed before it, and asserts its result.
#
#   bash gpu_check.sh [--compile]      # --compile: also time torch.compile, last
#
# Logs and summary.json go to $OUT when it is set, else to a new folder it names. The exit code
# is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
work=$(mktemp -d /tmp/gpu_check_work.XXXXXX)
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
export OMP_NUM_THREADS=4
py=python3
names=() results=() seconds=()

# step NAME COMMAND...: run it (5 min at most) with its output in $work/NAME.log; print the tail if it fails.
step() {
    local name=$1 began=$SECONDS status=pass
    shift
    echo "== $name"
    timeout 300 "$@" >"$work/$name.log" 2>&1 || status=FAIL
    if [[ $status == FAIL ]]; then tail -n 25 "$work/$name.log"; fi
    names+=("$name") results+=("$status") seconds+=($((SECONDS - began)))
}

# verify NAME PYTHON: assertions on the step's files; m(path) reads a metrics file, ck(path) a
# checkpoint, log(name) a step's output. A failed assertion turns the step's result to FAIL.
verify() {
    local name=$1 i
    if ! $py - "$work" "$name" >>"$work/$name.log" 2>&1 <<EOF
import json, math, sys, torch
work, name = sys.argv[1], sys.argv[2]
m = lambda path: [json.loads(line) for line in open(f"{work}/{path}")]
ck = lambda path: torch.load(f"{work}/{path}", map_location="cpu", weights_only=True)
log = lambda step: open(f"{work}/{step}.log").read()
def learned(path, epochs):
    records = m(path)
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1)), records
    assert all(math.isfinite(r["train_loss"]) for r in records), records
    assert records[-1]["train_loss"] < records[0]["train_loss"], records
    assert records[-1]["val_samples"] == 256 and len(set(records[-1]["replica_checksums"])) == 1, records
    return records
$2
print("verified")
EOF
    then
        tail -n 8 "$work/$name.log"
        for i in "${!names[@]}"; do [[ ${names[$i]} == "$name" ]] && results[$i]=FAIL; done
    fi
}

train=($py -m torch.distributed.run --standalone --nproc-per-node 1 train_ddp.py)

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c 'import sys, torch, torchvision
print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__,
      "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())),
      "GPUs", torch.cuda.device_count())'
df -h /dev/shm
# DataLoader workers pass batches through /dev/shm: 2 workers x 3 batches of 3 MB fit in any.
small=(--arch resnet18 --image-size 64 --train-samples 2048 --val-samples 256 --batch-size 64 --workers 2
       --epochs 2 --log-every 8)

step gather_nccl $py -m torch.distributed.run --standalone --nproc-per-node 1 test_gather.py --backend nccl
step gather_gloo_cuda $py -m torch.distributed.run --standalone --nproc-per-node 2 test_gather.py \
    --backend gloo --device cuda

step train_fp32 "${train[@]}" "${small[@]}" --checkpoint-dir "$work/fp32" --metrics-file "$work/fp32.jsonl"
verify train_fp32 'learned("fp32.jsonl", 2); assert "1 x cuda (nccl)" in log("train_fp32")'
step train_bf16_channels_last "${train[@]}" "${small[@]}" --amp bf16 --channels-last --checkpoint-dir "$work/bf16" \
    --metrics-file "$work/bf16.jsonl"
verify train_bf16_channels_last 'learned("bf16.jsonl", 2)'
step train_fp16 "${train[@]}" "${small[@]}" --amp fp16 --checkpoint-dir "$work/fp16" --metrics-file "$work/fp16.jsonl"
verify train_fp16 'learned("fp16.jsonl", 2); s = ck("fp16/last.pt")["scaler"]; assert 0 < s["scale"] <= 2**16, s'
for hook in fp16 bf16 powersgd; do
    step "hook_$hook" "${train[@]}" "${small[@]}" --comm-hook "$hook" --warmup-epochs 0.25 \
        --checkpoint-dir "$work/hook_$hook" --metrics-file "$work/hook_$hook.jsonl"
    verify "hook_$hook" "learned('hook_$hook.jsonl', 2)"
done
step sync_bn "${train[@]}" "${small[@]}" --sync-bn --checkpoint-dir "$work/sync_bn" --metrics-file "$work/sync_bn.jsonl"
verify sync_bn 'learned("sync_bn.jsonl", 2); assert "bn1.running_mean" in ck("sync_bn/last.pt")["model"]'

step resume "${train[@]}" "${small[@]}" --epochs 3 --resume "$work/fp32/last.pt" --checkpoint-dir "$work/fp32" \
    --metrics-file "$work/fp32.jsonl"
verify resume 'assert "at epoch 3 step 0" in log("resume"); learned("fp32.jsonl", 3)
assert ck("fp32/last.pt")["epoch"] == 3'
step evaluate "${train[@]}" "${small[@]}" --evaluate --resume "$work/fp32/last.pt" --metrics-file "$work/eval.jsonl"
verify evaluate 'e, = m("eval.jsonl"); t = m("fp32.jsonl")[-1]
assert e["epoch"] == 3 and e["val_samples"] == 256, e
assert abs(e["val_acc1"] - t["val_acc1"]) <= 100 / 256, (e, t)  # cudnn may pick other kernels: one image at most'

# SIGTERM mid-epoch to a one-process run: it saves last.pt at the step it reached and exits 0;
# the resumed run goes on from the next step. ($0 of the inline script is its log.)
sigterm_after_step_20='"$@" & for _ in $(seq 900); do grep -q "step 20/" "$0" && break; sleep 0.1; done
kill -TERM $!; wait $!'
long=(--epochs 1 --train-samples 16384 --checkpoint-dir "$work/sigterm")
step sigterm bash -c "$sigterm_after_step_20" "$work/sigterm.log" $py train_ddp.py "${small[@]}" "${long[@]}" \
    --log-every 1
verify sigterm 'assert "continue with --resume" in log("sigterm"), "no checkpoint line"
c = ck("sigterm/last.pt"); assert c["epoch"] == 0 and 20 <= c["step"] < 256, (c["epoch"], c["step"])'
step sigterm_resume "${train[@]}" "${small[@]}" "${long[@]}" --resume "$work/sigterm/last.pt"
verify sigterm_resume 'import re; stopped = re.search(r"SIGTERM at epoch 1 step (\d+)/", log("sigterm"))[1]
assert f"at epoch 1 step {stopped}" in log("sigterm_resume") and ck("sigterm/last.pt")["epoch"] == 1'

# Speed: ResNet-50 at 224 px, synthetic batches already on the GPU, one process without and with DDP.
bench=(bench_train.py --device cuda --nproc 1 --image-size 224 --batches 256 --steps 30 --warmup 15 --repeats 1
       --configs single "ddp default")
step speed_fp32 $py "${bench[@]}" --amp off
step speed_bf16_channels_last $py "${bench[@]}" --amp bf16 --channels-last
if [[ ${1:-} == --compile ]]; then
    step speed_bf16_channels_last_compile $py "${bench[@]}" --amp bf16 --channels-last --compile
fi
for name in "${names[@]}"; do
    if [[ $name == speed_* ]]; then echo "== $name"; grep '^|' "$work/$name.log"; fi
done

echo
printf '| step | result | seconds |\n|---|---|---|\n'
failed=0
for i in "${!names[@]}"; do
    printf '| %s | %s | %s |\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}"
    [[ ${results[$i]} == pass ]] || failed=$((failed + 1))
done
$py - "$out/summary.json" "${names[@]}" -- "${results[@]}" -- "${seconds[@]}" <<'EOF'
import json, sys
args = sys.argv[2:]
n = (len(args) - 2) // 3
names, results, seconds = args[:n], args[n + 1:2 * n + 1], args[2 * n + 2:]
steps = [{"step": a, "result": b, "seconds": int(c)} for a, b, c in zip(names, results, seconds)]
json.dump({"steps": steps, "failed": sum(s["result"] != "pass" for s in steps)}, open(sys.argv[1], "w"), indent=1)
EOF
tar -czf "$out/step_logs.tar.gz" -C "$work" --exclude '*.pt' .
echo "$failed step(s) failed; logs in $out"
exit $((failed > 0))
