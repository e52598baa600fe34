"""How messages name a line of model code (frontend/source_lines.py). A library's file is
named by its path inside the packages folder: a zoo run was refused "at torch.py:16" (einops'
``einops/_torch_specific.py``-style module named ``torch.py``), and litgpt's ``model.py`` read as
the user's own model.py. The user's files keep their base name."""
from __future__ import annotations

import importlib.util

import torch

from parallelizer.analysis.graph_facts import source_line
from parallelizer.frontend.source_lines import model_line

_LIB = ("import torch.nn as nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.proj(x).relu()\n")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relu_node(module):
    gm = torch.export.export(module.Block(), (torch.randn(2, 4),)).graph_module
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)


def test_a_package_file_is_named_by_its_path_in_the_packages_folder(tmp_path):
    lib = tmp_path / "lib" / "python3.11" / "site-packages" / "zoolib" / "model.py"
    lib.parent.mkdir(parents=True)
    lib.write_text(_LIB)
    relu = _relu_node(_load(lib, "zoolib_model"))
    assert source_line(relu) == "zoolib/model.py:7"
    assert model_line([relu]) == "zoolib/model.py:7"


def test_the_users_file_keeps_its_base_name(tmp_path):
    user = tmp_path / "model.py"
    user.write_text(_LIB)
    relu = _relu_node(_load(user, "user_model"))
    assert source_line(relu) == model_line([relu]) == "model.py:7"


def test_parallelizers_own_frames_are_never_the_models_line():
    """A keras 3 model's head was reported "at exporting.py:138": export records the
    wrapper by which parallelizer calls a ``*args`` forward as a frame of every node."""
    from parallelizer.frontend import exporting
    ours = f'  File "{exporting.__file__}", line 138, in forward\n    return cls_forward(m)\n'
    node = torch.fx.Graph().create_node("call_function", torch.relu, (), name="relu")
    node.meta["stack_trace"] = ours
    assert source_line(node) == ""
    node.meta["stack_trace"] = ours + f'  File "{__file__}", line 7, in forward\n    x\n'
    assert source_line(node) == "test_source_lines.py:7"
