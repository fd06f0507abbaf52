"""Test hook: the gradients of step 1, whole, as the optimizer would see them.

``WLB_TEST_GRADS=FILE`` makes every rank of a run launched by ``tests/fork_launch.py`` gather the
model's gradients right before TorchTitan clips them (after the backward passes of every
micro-batch and the data-parallel reduction), and rank 0 write them to ``FILE`` with
:func:`torch.save` as ``{parameter name: tensor}``. Sharded gradients (FSDP, HSDP) are gathered
to full tensors; every rank takes part in that gather, in the same order. Only the first step is
written. The package needs no test hooks: this wraps TorchTitan's ``clip_grad_norm_``.
"""

import os

import torch


def _full(grad: torch.Tensor) -> torch.Tensor:
    if hasattr(grad, "full_tensor"):  # a DTensor: FSDP/HSDP shards, gathered on every rank
        grad = grad.full_tensor()
    return grad.detach().clone().cpu()


def install(path: str) -> None:
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import Trainer

    original_clip = dist_utils.clip_grad_norm_
    original_step = Trainer.train_step
    names: dict[int, str] = {}
    written = False

    def train_step(self, data_iterator):
        if not names:
            for part in self.model_parts:
                names.update({id(p): n for n, p in part.named_parameters()})
        return original_step(self, data_iterator)

    def clip_grad_norm_(parameters, *args, **kwargs):
        nonlocal written
        parameters = list(parameters)
        if not written:
            grads = {names[id(p)]: _full(p.grad) for p in parameters if p.grad is not None}
            if int(os.environ.get("RANK", "0")) == 0:
                torch.save(grads, path)
            written = True
        return original_clip(parameters, *args, **kwargs)

    Trainer.train_step = train_step
    dist_utils.clip_grad_norm_ = clip_grad_norm_
