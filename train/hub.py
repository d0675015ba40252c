"""`python -m train.hub`: the export stage's Hub push (export/hub.py), under the name it was published with."""
import sys

from export.hub import main

if __name__ == "__main__":
    sys.exit(main())
