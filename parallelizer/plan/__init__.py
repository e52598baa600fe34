"""The data every layer shares: the ParallelPlan (``parallel_plan.py``), the planners'
decisions the passes read (``decisions.py``), tensor-parallel layouts (``layouts.py``),
pipeline schedules (``schedules.py``) and gradient-compression settings (``compression.py``).
No graphs and no tensors: JSON-serialisable values and pure functions of them."""
