"""``python -m anna.parallel.rank_main``: a tensor-parallel rank's process, started by rank 0 (or
by ``anna serve --node-rank N``) with its WorkerSpec pickled on stdin (parallel/workers.py)."""

import pickle
import sys

from anna.parallel.workers import run_worker

if __name__ == "__main__":
    run_worker(pickle.loads(sys.stdin.buffer.read()))
