"""timm's train.py idioms, written out (timm cannot run in CI: torchvision's wheels on our
registry are CUDA builds that do not import on CPU torch), and two timm-shaped models.

What each reproduces (timm 1.0.31): ``unwrap_model`` / ``get_state_dict``
(timm/utils/model.py: recursion on ``.module``), ``EmaV3`` (timm/utils/model_ema.py's
ModelEmaV3: a deep copy made before wrapping, lerped towards ``model.state_dict()``'s
values every step), ``distribute_bn`` (timm/utils/distributed.py: ``running_*`` buffers
all-reduced and averaged, or broadcast from rank 0, after each epoch) and
``rank0_save`` (CheckpointSaver and ``--recovery-interval``: rank 0 alone writes
``{"state_dict", "optimizer"}``, the other ranks train on).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    if hasattr(model, "module"):
        return unwrap_model(model.module)
    if hasattr(model, "_orig_mod"):
        return unwrap_model(model._orig_mod)
    return model


def get_state_dict(model: nn.Module) -> dict[str, Any]:
    return unwrap_model(model).state_dict()


class EmaV3(nn.Module):
    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        decay = 0.0 if step <= 1 else self.decay
        ema_values, model_values = [], []
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                ema_values.append(e)
                model_values.append(m)
            else:
                e.copy_(m)
        torch._foreach_lerp_(ema_values, model_values, weight=1.0 - decay)


def distribute_bn(model: nn.Module, world_size: int, reduce: bool = False) -> None:
    for name, buf in unwrap_model(model).named_buffers(recurse=True):
        if "running_mean" in name or "running_var" in name:
            if reduce:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                buf /= float(world_size)
            else:
                dist.broadcast(buf, 0)


def rank0_save(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int
               ) -> dict[str, Any] | None:
    """CheckpointSaver's save: on rank 0 only; what it would torch.save."""
    if dist.get_rank() != 0:
        return None
    return {"epoch": epoch, "arch": type(unwrap_model(model)).__name__,
            "state_dict": get_state_dict(model), "optimizer": optimizer.state_dict()}


# -- timm-shaped models ---------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                   nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """torchvision's / timm's layout: stem, ``layer1..layer4`` (Sequentials of blocks)."""

    def __init__(self, classes: int = 4, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        chans = [width, width * 2, width * 4, width * 8]
        c = width
        for i, w in enumerate(chans):
            setattr(self, f"layer{i + 1}", nn.Sequential(
                BasicBlock(c, w, 1 if i == 0 else 2), BasicBlock(w, w)))
            c = w
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(4):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """timm's VisionTransformer layout: its blocks in an ``nn.Sequential`` (not a ModuleList)."""

    def __init__(self, classes: int = 4, dim: int = 32, depth: int = 4, patch: int = 4,
                 image: int = 16) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])
