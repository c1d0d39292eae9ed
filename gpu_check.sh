#!/usr/bin/env bash
# The GPU checks, on one CUDA machine, in under 8 minutes: the gather tests over NCCL and over
# gloo with CUDA tensors, the training script end to end on NCCL, then ResNet50 training speed
# at 224 px on synthetic data already on the GPU. Usage: bash gpu_check.sh [log file]
set -euo pipefail
cd "$(dirname "$0")"
log=${1:-gpu_check.log}
exec > >(tee "$log") 2>&1
export OMP_NUM_THREADS=4

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'

echo "== gather tests: NCCL, one rank per GPU; gloo with CUDA tensors"
torchrun --standalone --nproc_per_node "$(nvidia-smi -L | wc -l)" test_gather.py --backend nccl
torchrun --standalone --nproc_per_node 2 test_gather.py --backend gloo --device cuda

echo "== train_ddp.py on NCCL, one short epoch"
bash launch.sh 1 --epochs 1 --train-samples 12800 --val-samples 1000 --checkpoint-dir /tmp/gpu_check_ckpt

echo "== ResNet50 training speed, 224 px, batch 256 per GPU"
bench="python3 bench_train.py --device cuda --nproc 1 --image-size 224 --batches 256 --steps 30 --warmup 15 --repeats 1 --configs single"
$bench --amp off
$bench --amp bf16
$bench --amp bf16 --channels-last
$bench --amp bf16 --channels-last --compile
