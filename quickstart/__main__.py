"""`python -m quickstart`: the whole pipeline on the tiny recipe (see quickstart/demo.py)."""
import sys

from quickstart.demo import main

if __name__ == "__main__":
    sys.exit(main())
