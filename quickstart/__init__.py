"""The fresh-machine quickstart: the one-command demo (`python -m quickstart`, quickstart/demo.py) that runs every
stage on the embedded default target (data_prep/default_target.py)."""
