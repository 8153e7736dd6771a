"""``python -m benchmarks``: the benchmark harness (see ``benchmarks.harness`` and the README)."""

from benchmarks.harness import main

if __name__ == "__main__":
    main()
