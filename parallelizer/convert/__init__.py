"""Checkpoint conversion without the model: any (tp, pp) layout to any (``reshard.py``),
Hugging Face export and import (``export.py``), and the target layout computed from the
manifest and the planners' partition (``target.py``)."""
