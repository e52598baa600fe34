"""The layout advisor (``parallelize plan``, ``check``, ``estimate``): a model as a workload
(``capture.py``, ``workload.py``), the cluster (``cluster.py``), step time and memory per
candidate layout (``step_time.py``), the search (``search.py``), the spec check
(``check.py``) and the exact per-rank memory of a compiled program (``memory.py``,
``activations.py``)."""
