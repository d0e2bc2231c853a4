"""Runs the benchmark suite: same as `python -m mmdispatch bench` (see
mmdispatch/bench.py for the options)."""
import sys

from mmdispatch.bench import main

if __name__ == "__main__":
    sys.exit(main())
