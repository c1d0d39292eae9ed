"""Batch norm with statistics over all ranks on the CPU (gloo), where torch's nn.SyncBatchNorm does not run.

train_ddp.py --sync-bn uses it on CPUs only (on GPUs, nn.SyncBatchNorm). Copy it beside train_ddp.py for that.
"""
import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """Batch norm with statistics over all ranks, for CPU/gloo (nn.SyncBatchNorm needs GPUs), for torchvision's
    affine BatchNorm2d layers. The sums travel through a differentiable all-reduce: the backward is synchronized too."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        c, xf = x.shape[1], x.float()
        count = xf.new_full((1,), x.numel() / c)
        totals = dist_nn.all_reduce(torch.cat([xf.sum((0, 2, 3)), (xf * xf).sum((0, 2, 3)), count]))
        n = totals[-1]
        mean = totals[:c] / n
        var = (totals[c:2 * c] / n - mean * mean).clamp_min(0)  # E[x²] - mean² can round below 0
        with torch.no_grad():
            self.num_batches_tracked += 1
            weight = 1 / self.num_batches_tracked.item() if self.momentum is None else self.momentum  # a plain average
            self.running_mean.lerp_(mean, weight)
            self.running_var.lerp_(var * n / (n - 1), weight)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return (xf * scale.view(1, c, 1, 1) + (self.bias - mean * scale).view(1, c, 1, 1)).to(x.dtype)


def convert_to_cpu_sync_bn(module):
    """Swap every BatchNorm2d for a CPUSyncBatchNorm with the same state (and state_dict keys)."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            sync = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum)
            sync.load_state_dict(child.state_dict())
            setattr(module, name, sync)
        else:
            convert_to_cpu_sync_bn(child)
    return module
