"""`python -m evaluation [COMMAND] ...`: bench, autotune, chi2, serve-check, serve-sweep (see evaluation/main.py)."""
import sys

from evaluation.main import main

if __name__ == "__main__":
    sys.exit(main())
