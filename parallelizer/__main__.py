"""``python -m parallelizer`` is the ``parallelize`` command."""
from parallelizer.cli.parallelize import main

raise SystemExit(main())
