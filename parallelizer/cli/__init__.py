"""Every entry point of the ``parallelize`` command: the compile (``parallelize.py``),
``inspect``, ``estimate``, ``plan`` / ``check`` and the checkpoint conversions (``convert.py``).
Argument parsing and printing only; the work is done by the packages below."""
