"""`python -m train.hub`: the export stage's Hub push (export/hub.py), under the name it was published with. Run, not
imported: export/ sits above train/ (docs/design.md, "Layout and ownership")."""
import runpy

if __name__ == "__main__":
    runpy.run_module("export.hub", run_name="__main__", alter_sys=True)
