"""A small PassManager: runs passes in order, dumps ``gm.code`` after each pass that
changed something (``--dump-passes DIR``), and wraps an internal failure with the failing
pass and the passes that ran before it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch.fx as fx

from ..errors import UserError


class PassManager:
    def __init__(self, dump_dir: Optional[Path] = None):
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.ran: list[str] = []

    def run(self, name: str, fn: Callable[..., bool], gm: fx.GraphModule, *args) -> bool:
        changed = self._call(name, fn, gm, *args)
        if changed:
            self._dump(name, gm.code)
        return changed

    def run_split(self, name: str, fn: Callable, gm: fx.GraphModule, *args) -> list:
        """A pass that returns stage graphs (StageGraph) instead of editing ``gm``."""
        stages = self._call(name, fn, gm, *args)
        for st in stages:
            self._dump(f"{name}.stage{st.index}", st.graph.python_code("self").src)
        return stages

    def _call(self, name, fn, gm, *args):
        try:
            out = fn(gm, *args)
        except UserError:
            raise
        except Exception as e:
            before = ", ".join(self.ran) or "none"
            raise RuntimeError(f"pass {name} failed (passes run before it: {before}): "
                               f"{type(e).__name__}: {e}") from e
        self.ran.append(name)
        return out

    def _dump(self, name: str, code: str) -> None:
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        (self.dump_dir / f"{len(self.ran):02d}_{name}.py").write_text(code)
