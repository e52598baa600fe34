"""The optimizer named in the spec, built the same way for the reference and the program."""
from __future__ import annotations

import torch


def make_optimizer(params, name: str, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``adamw`` (Loshchilov & Hutter 2019) or plain ``sgd`` over ``params``."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")
