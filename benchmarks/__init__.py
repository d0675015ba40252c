"""Speed and memory measurements, run by hand (`python benchmarks/NAME.py --help`); not timed tests."""
