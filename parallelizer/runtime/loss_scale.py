"""Dynamic loss scaling for ``mixed_precision.param_dtype: fp16`` (Micikevicius et al. 2018,
§3.2), global over the mesh: fp16 gradients overflow where fp32 ones do not, so the loss is
multiplied by ``scale`` before backward and the gradients divided by it after; a step whose
global gradient norm is not finite (an overflow on any rank: the norm is all-reduced over
every rank, runtime/clip.py) is skipped by every rank and the scale halved, and after
``GROWTH_INTERVAL`` finite steps in a row it is doubled (torch.amp.GradScaler's defaults).
Under fp32 and bf16 the scale is 1 and nothing is skipped. The state (scale, finite steps
since the last change) is saved in the checkpoint manifest and resumed.
"""
from __future__ import annotations

INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0


class LossScaler:
    def __init__(self, param_dtype: str):
        self.enabled = param_dtype == "fp16"
        self.scale = INIT_SCALE if self.enabled else 1.0
        self.good_steps = 0
        self.skipped = 0

    def unscale_(self, norm) -> None:
        """Divide every local gradient by the scale (``norm``: runtime/clip.GradNorm)."""
        if self.enabled:
            norm.scale_(1.0 / self.scale)

    def skip_step(self, step: int, ctx) -> bool:
        """An overflow at ``step``: True (skip it, scale halved) when scaling is on and the
        scale can still be lowered; False means the non-finite value is real."""
        if not self.enabled or self.scale <= MIN_SCALE:
            return False
        self.scale /= 2
        self.good_steps = 0
        self.skipped += 1
        if ctx.rank == 0:
            print(f"loss scale: step {step} overflowed in fp16; skipped, scale now {self.scale:g}",
                  flush=True)
        return True

    def update(self) -> None:
        """After a finite step."""
        if not self.enabled:
            return
        self.good_steps += 1
        if self.good_steps >= GROWTH_INTERVAL:
            self.scale *= 2
            self.good_steps = 0

    def state(self) -> dict | None:
        return {"scale": self.scale, "good_steps": self.good_steps} if self.enabled else None

    def load(self, state: dict | None) -> None:
        if self.enabled and state:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
