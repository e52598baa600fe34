"""Which modules run in training mode: the model as built, or as a training loop sets it.

A model built with every module in eval mode (``from_pretrained`` returns it so) is
compiled in training mode, as the ``model.train()`` before a training loop sets it:
dropout then draws in ``--train`` and BatchNorm normalises by the batch's statistics and
updates its running statistics; a warning says so when the model holds such modules. A
model built with some modules in training mode and others in eval mode (``model.train()``
then ``bn.eval()`` for each BatchNorm: a frozen BatchNorm when fine-tuning a detector) is
compiled with each module's mode as built: the eval ones are captured as eval runs them (a
BatchNorm on its running statistics, writing none), in the program, the reference and the
self-check alike. It was always switched to training mode, silently (a break test: a
frozen BatchNorm's running statistics drifted under ``--train``).
"""
from __future__ import annotations

import torch
from torch import nn

_MODE_DEPENDENT = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm,
                   nn.modules.instancenorm._InstanceNorm)


def training_modes(model: torch.nn.Module) -> list[str]:
    """Put ``model`` in training mode when no module of it is (see the module docstring);
    returns the warning for it, or []."""
    if any(m.training for m in model.modules()):
        return []
    model.train()
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _MODE_DEPENDENT)
                    and (not isinstance(m, nn.modules.dropout._DropoutNd) or m.p > 0)})
    if not kinds:
        return []
    return [f"the model was built in eval mode (no module in training mode, as from_pretrained "
            f"returns it); it is compiled in training mode, as model.train() before a training "
            f"loop sets it: its {', '.join(kinds)} modules run as in training (dropout drawn in "
            f"--train, BatchNorm on the batch's statistics, updating its running statistics). "
            f"To keep some modules in eval mode (a frozen BatchNorm), build the model with "
            f"model.train() and then .eval() on those modules: a model with modules in both "
            f"modes is compiled with each module's mode as built"]
