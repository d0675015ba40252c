"""Fault tier, config class: every CLI refuses a bad recipe, key or value in ONE stderr line (exit 2), before any
stage starts and without touching the run folder; `--debug` / EAGLE_DEBUG show the traceback instead."""
from __future__ import annotations

import importlib

import pytest

from fault_helpers import assert_one_line_error, assert_unchanged, run_cli, snapshot

CLIS = {  # name -> (module, extra argv every call needs)
    "train": ("train.main", []),
    "data_prep": ("data_prep.main", []),
    "evaluation": ("evaluation.main", []),
    "hub": ("export.hub", ["--dry-run"]),
    "corpus_cache": ("data_prep.corpus_cache", ["--text", "unused.txt"]),
    "eval_head": ("train.eval_head", ["--head", "unused"]),
    "quickstart": ("quickstart.demo", []),
}

CASES = [  # (cli, override, needles): each a distinct bad value or key
    ("train", "train.lr=-1", ["train.lr", "> 0"]),
    ("train", "train.lr=nan", ["train.lr", "finite"]),
    ("train", "train.warmup_steps=-1", ["train.warmup_steps", ">= 0"]),
    ("train", "train.schedule=step", ["train.schedule", "linear"]),
    ("train", "train.precision=fp8", ["train.precision", "bf16"]),
    ("train", "train.zero_stage=4", ["train.zero_stage"]),
    ("train", "train.betas=[0.9]", ["train.betas"]),
    ("train", "train.max_loss_ratio=0.5", ["train.max_loss_ratio"]),
    ("train", "train.max_steps=abc", ["train.max_steps"]),
    # issue 28 item 7: a value of the wrong type names the key, the type it takes and an example, in our words
    ("train", "train.lr=abc", ["train.lr='abc': expected a number, e.g. train.lr="]),
    ("train", "train.betas=0.9", ["train.betas=0.9: expected a list of numbers, e.g. train.betas=[0.9,0.95]"]),
    ("train", "head.bias=maybe", ["head.bias='maybe': expected true or false, e.g. head.bias=true"]),
    ("train", "head.aux_layers=[1,x,3]", ["head.aux_layers[1]='x': expected a whole number", "head.aux_layers=[1,2,3]"]),
    ("train", "data.max_records=many", ["data.max_records='many': expected a whole number or null"]),
    ("train", "target=5", ["target='5': target is a section", "target.path"]),
    ("train", "train.learning_rate=1", ["unknown recipe key 'train.learning_rate'", "train.lr"]),
    ("train", "train.deepspeed.optimizer.type=SGD", ["train.deepspeed", "optimizer"]),
    ("train", "logging.backend=csv", ["logging.backend"]),
    ("train", "export.dtype=int8", ["export.dtype"]),
    ("train", "train.device=tpu", ["train.device"]),
    ("data_prep", "data.cache_dtype=int4", ["data.cache_dtype", "int8"]),
    ("data_prep", "data.overlong=cut", ["data.overlong", "truncate"]),
    ("data_prep", "data.format=xml", ["data.format", "sharegpt"]),
    ("data_prep", "data.top_p=0", ["data.top_p"]),
    ("data_prep", "data.max_length=1", ["data.max_length"]),
    ("data_prep", "data.backend=grpc", ["data.backend"]),
    ("data_prep", "data.on_length_limit=trim", ["data.on_length_limit"]),
    ("data_prep", "data.max_records=0", ["data.max_records"]),
    ("data_prep", "data.tool_call_format=xml", ["data.tool_call_format", "hermes"]),
    ("evaluation", "eval.top_p=2", ["eval.top_p"]),
    ("evaluation", "eval.confidence_level=1", ["eval.confidence_level"]),
    ("evaluation", "eval.temperature=-1", ["eval.temperature"]),
    ("evaluation", "decoding.mode=beam", ["decoding.mode", "dynamic"]),
    ("evaluation", "decoding.static_choices=nope", ["decoding.static_choices", "mc_sim_7b_63"]),
    ("evaluation", "decoding.total_token=1", ["total_token"]),
    ("evaluation", "target.dtype=int8", ["target.dtype", "bfloat16"]),
    ("evaluation", "target.attn_implementation=flash_attention_2", ["target.attn_implementation"]),
    ("evaluation", "eval.methods=[]", ["eval.methods"]),
    ("evaluation", "eval.tune_top_ks=[0]", ["eval.tune_top_ks"]),
    ("hub", "export.push_to_hub=true", ["export.repo_id"]),
    ("corpus_cache", "seed=-1", ["seed"]),
    ("eval_head", "train.eval_fraction=1.0", ["train.eval_fraction"]),
    ("quickstart", "output_dir=", ["output_dir"]),
    ("quickstart", "target.chat_template=no-such-template", ["target.chat_template"]),
    ("train", "output_dir=${nope}", ["nope"]),
]


def cli_main(name):
    return importlib.import_module(CLIS[name][0]).main


@pytest.mark.parametrize("cli,override,needles", CASES, ids=[f"{c}:{o.split('=')[0]}" for c, o, _ in CASES])
def test_bad_value_is_one_line_before_any_work(cli, override, needles, tmp_path, capsys):
    good = tmp_path / "run"
    (good / "train").mkdir(parents=True)
    (good / "train" / "summary.json").write_text('{"steps": 3}')
    before = snapshot(tmp_path)
    argv = ["--recipe", "tiny", *CLIS[cli][1], f"output_dir={good}", override]
    if cli == "quickstart" and override.startswith("output_dir"):
        argv = ["--recipe", "tiny", override]
    code, _, err = run_cli(cli_main(cli), argv, capsys)
    assert_one_line_error(code, err, *needles)
    assert_unchanged(before, tmp_path)


RECIPE_FILES = [  # (file content, needles): broken recipe files, named in the message
    (b"train:\n  lr: [1, 2\n", ["invalid YAML"]),
    (b"- just\n- a list\n", ["expected a mapping"]),
    (b"name: caf\xe9\n", ["not valid UTF-8"]),
    (b"train:\n  nope: 1\n", ["unknown recipe key 'train.nope'"]),
    (b"train:\n  lr: fast\n", ["train.lr='fast' (recipe ", "broken.yaml): expected a number"]),
]


RECIPE_CASES = [(cli, *case) for cli in ("train", "data_prep", "evaluation", "quickstart") for case in RECIPE_FILES
                if cli == "train" or case[1][0] in ("invalid YAML", "not valid UTF-8")]


@pytest.mark.parametrize("cli,content,needles", RECIPE_CASES, ids=[f"{c}:{n[0]}" for c, _, n in RECIPE_CASES])
def test_broken_recipe_file_is_named(cli, content, needles, tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    before = snapshot(tmp_path)
    code, _, err = run_cli(cli_main(cli), ["--recipe", path, *CLIS[cli][1]], capsys)
    line = assert_one_line_error(code, err, *needles)
    if needles[0] in ("invalid YAML", "expected a mapping", "not valid UTF-8"):
        assert "broken.yaml" in line
    assert_unchanged(before, tmp_path)


def test_missing_recipe_and_bad_arguments_are_one_line(tmp_path, capsys):
    for cli in CLIS:
        code, _, err = run_cli(cli_main(cli), ["--recipe", tmp_path / "nope.yaml", *CLIS[cli][1]], capsys)
        assert_one_line_error(code, err, "nope.yaml", "not found")
    code, _, err = run_cli(cli_main("train"), ["--recipe", "tiny", "--bogus"], capsys)
    assert_one_line_error(code, err, "--bogus")
    code, _, err = run_cli(cli_main("data_prep"), ["--recipe", "tiny", "--shard", "3/2"], capsys)
    assert_one_line_error(code, err, "--shard")
    code, _, err = run_cli(cli_main("data_prep"), ["--recipe", "tiny", f"output_dir={tmp_path}", "load", "cache"], capsys)
    assert_one_line_error(code, err, "at most one stage")
    code, _, err = run_cli(cli_main("quickstart"), ["not-an-override"], capsys)
    assert_one_line_error(code, err, "key=value")


def test_debug_flag_and_env_show_the_traceback(monkeypatch, capsys):
    from recipes import RecipeError

    main = cli_main("train")
    with pytest.raises(RecipeError, match="train.lr"):
        main(["--recipe", "tiny", "train.lr=-1", "--debug"])
    monkeypatch.setenv("EAGLE_DEBUG", "1")
    with pytest.raises(RecipeError, match="data.cache_dtype"):
        cli_main("data_prep")(["--recipe", "tiny", "data.cache_dtype=int4"])
    monkeypatch.setenv("EAGLE_DEBUG", "0")
    code, _, err = run_cli(main, ["--recipe", "tiny", "train.lr=-1"], capsys)
    assert_one_line_error(code, err, "train.lr")


def test_every_shipped_recipe_and_schema_edge_values_validate():
    from recipes import list_recipes, load_config

    for name in list_recipes():
        load_config(name)
    load_config("tiny", ["train.warmup_steps=0", "train.max_loss_ratio=0", "data.max_records=null", "eval.top_p=1",
                         "train.eval_fraction=0", "train.num_workers=0", "eval.max_length=0", "data.top_p=1"])


def test_help_documents_debug(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main("evaluation")(["--help"])
    assert e.value.code == 0 and "--debug" in capsys.readouterr().out


def test_quickstart_stage_failure_is_one_line(tmp_path, monkeypatch, capsys):
    """A user error found by a stage (here data prep: a data file that does not exist) ends the demo with the
    stage's own line on stderr, exit 2; the stage's progress went to stdout and the good default target stayed."""
    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--target-size", "test", "--out", tmp_path / "run", "--eagle3-override", "head.aux_layers=[0,1,2]",
            f"data.source={tmp_path / 'no_such.json'}"]  # the aux layers of the 3-layer test target
    code, out, err = run_cli(cli_main("quickstart"), argv, capsys)
    line = assert_one_line_error(code, err, "stage data", "no_such.json", "does not exist", "rerun")
    assert "[quickstart] 2/8 data prep" in out and line not in out
    target = tmp_path / "home" / "default-target-test"
    before = snapshot(target)
    code, _, err = run_cli(cli_main("quickstart"), argv, capsys)  # the rerun reuses the target and fails the same way
    assert assert_one_line_error(code, err) == line
    assert_unchanged(before, target)


# ----------------------------------------------------------------------------- issue 28 items 11-12: the CLIs' edges
NUMERIC_FLAGS = [  # (cli module, argv, needles): every numeric flag is range-checked before any work
    ("data_prep.corpus_cache", ["--text", "t.txt", "--first", "-3"], ["--first: -3: expected an integer >= 0"]),
    ("data_prep.corpus_cache", ["--text", "t.txt", "--continue-with-target", "-4"], ["--continue-with-target: -4"]),
    ("data_prep.corpus_cache", ["--text", "t.txt", "--batch-size", "0"], ["--batch-size: 0: expected an integer >= 1"]),
    ("data_prep.corpus_cache", ["--text", "t.txt", "--temperature", "-1"], ["--temperature: -1: expected a finite number >= 0"]),
    ("data_prep.corpus_cache", ["--text", "t.txt", "--first", "ten"], ["--first: 'ten': expected an integer"]),
    ("data_prep.main", ["--inspect", "-1"], ["--inspect: -1"]),
    ("export.cli", ["--format", "vllm", "--head", "h", "--num-speculative-tokens", "0"], ["--num-speculative-tokens: 0"]),
    ("evaluation.main", ["serve-check", "--num-speculative-tokens", "0"], ["--num-speculative-tokens: 0"]),
    ("evaluation.main", ["serve-check", "--tolerance", "inf"], ["--tolerance: inf: expected a finite number >= 0"]),
    ("evaluation.main", ["serve-check", "--num-prompts", "0"], ["--num-prompts: 0"]),
]


@pytest.mark.parametrize("module,argv,needles", NUMERIC_FLAGS, ids=[f"{m}:{a[-2]}" for m, a, _ in NUMERIC_FLAGS])
def test_numeric_flags_are_range_checked_before_any_work(module, argv, needles, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(module).main
    code, _, err = run_cli(main, [*argv, "--recipe", "tiny"], capsys)  # evaluation: the command comes first
    assert_one_line_error(code, err, *needles)
    assert not any(tmp_path.iterdir())


def test_unknown_evaluation_command_and_per_command_help(capsys):
    main = cli_main("evaluation")
    code, _, err = run_cli(main, ["autotun", "--recipe", "tiny"], capsys)
    assert_one_line_error(code, err, "unknown command 'autotun'", "did you mean autotune?", "serve-check")
    helps = {}
    for command in ("bench", "autotune", "chi2", "serve-check"):
        code, out, _ = run_cli(main, [command, "--help"], capsys)
        assert code == 0 and f"python -m evaluation {command}" in out
        helps[command] = out
    assert "--engine-python" in helps["serve-check"] and "--engine-python" not in helps["autotune"]
    assert "tree_config.json" in helps["autotune"] and "losslessness at temperature" in helps["chi2"]
    assert len(set(helps.values())) == 4
    code, out, _ = run_cli(main, ["--help"], capsys)  # the top level lists every command
    assert code == 0 and all(c in out for c in helps) and "COMMAND --help" in out
    code, _, err = run_cli(main, ["autotune", "--engine-python", "x"], capsys)  # another command's option
    assert_one_line_error(code, err, "--engine-python")


def test_debug_shows_a_traceback_for_every_kind_of_error(tmp_path, monkeypatch, capsys):
    """Issue 28 item 15: --debug / EAGLE_DEBUG=1 show where an error came from whatever its kind: an exception, a
    `raise SystemExit("message")`, an argparse usage error, an error a command used to print itself (train.plan)."""
    from eagle.cli_errors import debug_enabled, one_line_errors
    from recipes import RecipeError
    from train.plan import main as plan_main

    data_prep = cli_main("data_prep")
    args = ["--recipe", "tiny", f"output_dir={tmp_path}", "load", "cache"]
    code, _, err = run_cli(data_prep, args, capsys)  # without: one line
    assert_one_line_error(code, err, "at most one stage")
    code, _, err = run_cli(data_prep, [*args, "--debug"], capsys)  # SystemExit("message"): traceback, then the message
    assert "Traceback" in err and "at most one stage" in err and "data_prep/main.py" in err
    with pytest.raises(RecipeError):
        plan_main(["--recipe", "tiny", "head.kind=eagle9", "--debug"])
    monkeypatch.setenv("EAGLE_DEBUG", "1")
    code, _, err = run_cli(cli_main("train"), ["--recipe", "tiny", "--bogus"], capsys)  # usage error: the call stack
    assert code == 2 and 'File "' in err and "--bogus" in err.splitlines()[-1]
    monkeypatch.delenv("EAGLE_DEBUG")

    seen = []

    @one_line_errors
    def probe(argv):
        seen.append(debug_enabled())  # what quickstart asks before passing EAGLE_DEBUG=1 to its stages
        return 0

    assert probe(["--debug"]) == 0 and probe([]) == 0 and seen == [True, False]
