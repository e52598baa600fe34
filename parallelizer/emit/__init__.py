"""The emitter: program source per stage (``stages.py``), OUT/ written atomically
(``program.py``), report.md (``report.py``), the reference step (``reference.py``), the
pipeline plots (``plots.py``), node placement and launch files (``launch.py``)."""
