"""`python -m eagle_train`: the `eagle-train` command without the installed script (eagle_train/cli.py)."""
import sys

from eagle_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
