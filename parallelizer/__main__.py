"""``python -m parallelizer`` is the ``parallelize`` command."""
from parallelizer.cli import main

raise SystemExit(main())
