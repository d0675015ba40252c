"""The export stage: what is made from a trained head folder (the official EAGLE layout train/ writes): the folders
serving engines load (engine_formats.py, with drift checks against the target, config_drift.py), the Hub model card
(model_card.py) and the Hub push (hub.py). Commands: `python -m train.export` (cli.py) and `python -m train.hub`."""
