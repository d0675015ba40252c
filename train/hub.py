"""`python -m train.hub`: the export stage's Hub push (export/hub.py), under the name it was published with."""
import runpy

if __name__ == "__main__":
    runpy.run_module("export.hub", run_name="__main__", alter_sys=True)
