"""Module paths export spells through a slice of a ModuleList (frontend/module_paths.py).

transformers' decoders run ``for layer in self.layers[: self.config.num_hidden_layers]``;
called through peft's ``PeftModel`` (prompt tuning) export names the layers
``base_model.model.layers.slice(None, 4, None).0``, which matched no FQN: the pipeline split
found no block in stage 0 and the compile failed with an internal error (``SplitMismatch``,
zoo 13 Z16; peft 0.21 prompt tuning on Llama now passes --verify at pp2). Such a path is
resolved on the model to the module it reaches and named by that module's FQN."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallelizer.analysis.graph_facts import module_path
from parallelizer.frontend import capture as cap, module_paths


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in self.layers[:4]:
            x = x + layer(x)
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.base_model = Inner()

    def forward(self, x):
        return self.base_model(x)


def test_a_path_through_a_slice_names_the_module_it_reaches():
    model = Outer()
    assert module_paths._module_at(model, "base_model.layers.slice(None, 4, None).2") \
        is model.base_model.layers[2]
    assert module_paths._module_at(model, "base_model.layers.slice(1, None, 2).1") \
        is model.base_model.layers[3]
    assert module_paths._module_at(model, "base_model.layers.slice(None, 4, None).9") is None
    assert module_paths._module_at(model, "base_model.nothing") is None


def test_the_capture_names_sliced_paths_by_their_fqn():
    torch.manual_seed(0)
    model = Outer()
    gm = cap.capture(model, (torch.randn(2, 3, 8),), Path("model.py")).gm
    # the graph as export spells it under peft: every layer's path through the slice
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            n.meta["nn_module_stack"] = {k: (p.replace("layers.", "layers.slice(None, 4, None)."),
                                             kind) for k, (p, kind) in stack.items()}
    assert any("slice(" in module_path(n) for n in gm.graph.nodes)
    module_paths.one_name_per_module(gm, model)
    paths = {module_path(n) for n in gm.graph.nodes} - {""}
    assert paths == {"base_model"} | {f"base_model.layers.{i}" for i in range(4)}, paths
