"""The evaluation stage (`python -m evaluation`, `eagle-train eval|autotune|chi2|serve-check|serve-sweep`): tau and
speed-up against vanilla with bootstrap CIs, calibration, losslessness (greedy identity, chi-square at T > 0), tree
auto-tuning, the head decoded inside vLLM against this decoder (serve-check) and vLLM's throughput per draft length
(serve-sweep), through engine/; reports."""
