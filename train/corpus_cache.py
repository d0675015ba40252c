"""`python -m train.corpus_cache`: the feature cache from a plain-text corpus, under the name it was published with.
The code is data prep's (data_prep/corpus_cache.py); `eagle-train corpus` runs the same command."""
import sys

from data_prep.corpus_cache import main

if __name__ == "__main__":
    sys.exit(main())
