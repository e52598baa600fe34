"""Sharding propagation over the captured graph (``propagate.py``): every node's
placement under a tp degree, from DTensor's op strategies (``dtensor.py``) and our own rules
where they do not express the answer (``rules.py``, ``layouts.py``, ``heads.py``,
``strided.py``); the recorded state in ``state.py``, the placement values (DTensor's
``Shard`` / ``Replicate``, plus ``PerOutput`` and ``CONFLICT``) in ``placements.py``."""
