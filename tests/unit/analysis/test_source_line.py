"""The source line a message names (analysis/graph_facts.source_line): the innermost frame
of the node's stack trace in a file the user can open. A frame of code generated at run time
(exec'd code, whose file exists nowhere) was named; the frame that called it is named
instead."""
from __future__ import annotations

import torch.fx as fx

from parallelizer.analysis.graph_facts import source_line


def test_a_frame_of_generated_code_is_skipped():
    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = (
        f'  File "{__file__}", line 7, in forward\n    x = generated(x)\n'
        '  File "/nowhere/generated/ops.py", line 16, in op\n    x = x.reshape(4, 8)\n')
    assert source_line(node) == "test_source_line.py:7"
    assert source_line(node, outer=1) == ""
