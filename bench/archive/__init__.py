"""Finished investigations: their results are recorded in docs/lab/ and docs/bench-logs/ (README.md here says
where); kept runnable as ``python -m bench.archive.<name>``."""
