"""On-demand benchmarks (never part of the test run)."""
