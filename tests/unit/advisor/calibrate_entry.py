"""One rank of test_calibrate.py: ``parallelize calibrate --mode test`` on the cluster file
given, in the mode given (default test: the reduced grids; every rank measures, rank 0
writes the file)."""
import sys

from parallelizer.cli.calibrate import main

if __name__ == "__main__":
    sys.exit(main(["--cluster", sys.argv[1], "--mode", sys.argv[2] if len(sys.argv) > 2 else "test"]))
