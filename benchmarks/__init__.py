"""Speed and memory measurements, run by hand from a checkout's root (`python -m benchmarks.NAME --help`; the package
is not installed); not timed tests."""
