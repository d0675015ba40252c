"""`eagle-train`: the project's one command, a subcommand per pipeline stage (eagle_train/cli.py). Each subcommand
is the stage's own command-line program, run in this process with the same options, output and exit codes as its
documented invocation (`python train/main.py`, `python -m train.plan`, ...), which keep working."""
