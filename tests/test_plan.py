"""train/plan.py: the memory / disk / time arithmetic, the shipped recipes' verdicts on 8 x 24 GB, the knobs it
names, the CLI, and the plan printed at the start of a run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recipes import load_config
from test_train_helpers import REPO, subprocess_env
from train.plan import GB, Hardware, build_plan, memory_items, model_states, plan_shape

SEVEN_B = ("llama3-8b", "llama2-chat-7b", "vicuna-7b", "qwen2-7b",
           "llama3-8b-eagle3", "llama2-chat-7b-eagle3", "vicuna-7b-eagle3", "qwen2-7b-eagle3")


@pytest.fixture(scope="module")
def llama_shape():
    return plan_shape(load_config("llama3-8b", []))


def test_llama3_head_shape_is_the_published_one(llama_shape):
    s = llama_shape
    H, I, kv = 4096, 14336, 8 * 128
    expected = 2 * H * H + (H * H + 2 * kv * H + H * H) + 3 * H * I + H  # fc (no bias) + attention + MLP + norm
    assert (s.hidden, s.vocab, s.intermediate, s.heads, s.kv_heads) == (4096, 128256, 14336, 32, 8)
    assert s.head_trainable == expected  # 251.7M
    assert 8.0e9 < s.target_params < 8.1e9  # Llama-3-8B: 8.03B


def test_zero2_mixed_precision_states_are_deepspeeds_estimate():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P = 251_662_336
    items = model_states(P, P, 2, "fp16", 8, 8, 1, offload=False, host=False)
    _, gpu = estimate_zero2_model_states_mem_needs(P, 8, 1, cpu_offload=False)
    assert sum(i.bytes for i in items) == pytest.approx(gpu)
    fp32 = model_states(P, P, 2, "fp32", 1, 1, 1, offload=False, host=True)  # what one CPU process holds
    held = sum(i.bytes for i in fp32 if not i.phases)
    assert held == 4 * P + 4 * P + 8 * P  # params, master, AdamW: held all run
    # the gradient partition and torch AdamW's temporaries (sqrt(v), the flat fp32 grad copy) exist in the step
    assert sum(i.bytes for i in fp32 if i.phases == ("step",)) == 4 * P + 8 * P


@pytest.mark.parametrize("recipe", SEVEN_B)
def test_shipped_7b_recipes_fit_a_24gb_rtx3090(recipe):
    cfg = load_config(recipe, [])
    plan = build_plan(cfg, Hardware(gpus=8, gpu_mem_gb=24))
    assert plan.fits, plan.verdict
    assert plan.verdict.startswith("fits")
    assert {"head activations", "token-loss logits", "frozen lm_head", "DeepSpeed reduce bucket"} <= {i.name for i in plan.memory}


def test_unchunked_loss_is_the_knob_it_names(llama_shape):
    """At 2 x 2048 tokens and V = 128,256 the unchunked token loss alone is ~12 GB: on a 16 GB GPU the plan must
    say it does not fit and name train.loss_chunk first."""
    cfg = load_config("llama3-8b", ["train.loss_chunk=0"])
    items = {i.name: i.bytes for i in memory_items(cfg, Hardware(), llama_shape)}
    assert items["token-loss logits"] > 4096 * 128256 * 20  # several fp32 [4096, V] tensors
    chunked = {i.name: i.bytes for i in memory_items(load_config("llama3-8b", []), Hardware(), llama_shape)}
    assert chunked["token-loss logits"] < items["token-loss logits"] / 10
    plan = build_plan(cfg, Hardware(gpu_mem_gb=16), llama_shape)
    assert not plan.fits and plan.knobs[0].startswith("train.loss_chunk=")
    assert "does NOT fit" in plan.verdict and "train.loss_chunk=" in plan.verdict


def test_memory_scales_with_the_micro_batch_and_world(llama_shape):
    cfg1, cfg2 = load_config("llama3-8b", ["train.micro_batch_size=1"]), load_config("llama3-8b", ["train.micro_batch_size=4"])
    a = {i.name: i.bytes for i in memory_items(cfg1, Hardware(), llama_shape)}
    b = {i.name: i.bytes for i in memory_items(cfg2, Hardware(), llama_shape)}
    assert b["head activations"] == pytest.approx(4 * a["head activations"])
    one = {i.name: i.bytes for i in memory_items(cfg1, Hardware(gpus=1), llama_shape)}
    assert one["AdamW moments (fp32)"] == pytest.approx(8 * a["AdamW moments (fp32)"])


def test_mixtral_online_needs_more_than_24gb_and_offline_fits():
    off = build_plan(load_config("mixtral-8x7b", []), Hardware())
    assert off.fits, off.verdict
    on = build_plan(load_config("mixtral-8x7b", ["train.mode=online"]), Hardware())
    assert not on.fits and any(k.startswith("train.mode=offline") for k in on.knobs)
    target = next(i for i in on.memory if i.name == "frozen target (online mode)")
    assert target.bytes > 90 * GB  # 46.7B params in bf16
    assert 12.5e9 < off.shape.target_active_params < 13.5e9  # top-2 of 8 experts: ~12.9B per token


def test_disk_is_bytes_per_token_times_tokens(llama_shape):
    plan = build_plan(load_config("llama3-8b", []), Hardware(), llama_shape, tokens=1_000_000)
    disk = {i.name.split()[2]: i.bytes for i in plan.disk}
    assert disk["bfloat16"] == (4096 * 2 + 5) * 1_000_000
    assert disk["int8"] == (4096 + 7) * 1_000_000
    assert all(i.bytes > 0 for i in plan.time)


def test_eagle3_is_planned_from_its_keys(llama_shape):
    cfg = load_config("llama3-8b", ["head.kind=eagle3", "head.draft_vocab_size=32000", "head.ttt_steps=7",
                                    "head.ttt_row_stride=4"])
    s = plan_shape(cfg)
    H = 4096
    assert s.kind == "eagle3" and s.cache_row == 4 and s.ttt_steps == 7
    # fc 3H x H (EAGLE-2's 2H x H), q/k/v read 2H, lm_head [32000, H], 3 more RMSNorms (input_layernorm, hidden_norm,
    # the final norm) beside the shared post_attention_layernorm; counted on the module (the old per-kind formula
    # counted 2 of those norms)
    assert s.head_trainable - llama_shape.head_trainable == H * H + (32 + 16) * 128 * H + 32000 * H + 3 * H
    plan = build_plan(cfg, Hardware(), s, tokens=1000)
    assert plan.disk[0].bytes == (4 * H * 2 + 5) * 1000
    # train.loss_chunk=0: full-vocabulary target logits + the draft logits of every unrolled step
    n = cfg.train.micro_batch_size * cfg.data.max_length
    rows = n + 6 * (n // 4)  # steps >= 2 at every 4th position
    unchunked = load_config("llama3-8b", ["head.kind=eagle3", "head.draft_vocab_size=32000", "head.ttt_steps=7",
                                          "head.ttt_row_stride=4", "train.loss_chunk=0"])
    loss = {i.name: i.bytes for i in memory_items(unchunked, Hardware(), s)}["token-loss logits"]
    assert loss == n * 128256 * 4 + n * 32000 * 4 + rows * 32000 * (2 + 8)
    # chunked (the default train.loss_chunk=256, DraftVocabTargets.chunked): one chunk's logits, not n's
    items = {i.name: i.bytes for i in memory_items(cfg, Hardware(), s)}
    assert items["token-loss logits"] == 256 * (128256 * (2 + 4) + 32000 * (2 + 20))
    assert items["token-loss checkpoints"] == rows * (H * (2 + 4) + 8) + n * 8


def test_nodes_add_inter_node_traffic_per_zero_stage(llama_shape):
    """--nodes 2 --gpus 8: per-rank memory over 16 ranks, each node's network bytes per step by ZeRO stage (ring
    volumes: ZeRO-3 moves 1.5x the data of ZeRO-1/2 at grad_accum 1), and their time in the estimate."""
    def plan(stage, nodes, accum=1):
        cfg = load_config("llama3-8b", [f"train.zero_stage={stage}", f"train.grad_accum={accum}"])
        return build_plan(cfg, Hardware(gpus=8, nodes=nodes), llama_shape)

    P, ring = llama_shape.head_trainable, 15 / 16
    traffic = {z: sum(i.bytes for i in plan(z, 2).traffic) for z in (1, 2, 3)}
    assert traffic[1] == pytest.approx(2 * ring * P * 2) and traffic[2] == pytest.approx(traffic[1])
    assert traffic[3] == pytest.approx(1.5 * traffic[1])
    assert sum(i.bytes for i in plan(2, 2, accum=4).traffic) == pytest.approx(5 * ring * P * 2)  # 4 reduce + 1 gather
    assert plan(2, 1).traffic == [] and "training: inter-node traffic" not in {i.name for i in plan(2, 1).time}
    one, two = ({i.name: i for i in plan(2, n).time} for n in (1, 2))
    assert two["training"].bytes == pytest.approx(one["training"].bytes / 2)  # twice the GPUs
    assert two["training: inter-node traffic"].bytes > 0
    ram = {i.name: i.bytes for i in plan(2, 2).memory}
    assert ram["AdamW moments (fp32)"] == pytest.approx({i.name: i.bytes for i in plan(2, 1).memory}["AdamW moments (fp32)"] / 2, rel=0.01)


def test_cli_table_help_and_one_line_errors(capsys):
    from train.plan import main

    ok = subprocess.run([sys.executable, "-m", "train.plan", "--recipe", "llama3-8b", "--gpus", "8", "--gpu-mem-gb", "24"],
                        env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "fits:" in ok.stdout and "token-loss logits" in ok.stdout and "feature cache bfloat16" in ok.stdout
    two = subprocess.run([sys.executable, "-m", "train.plan", "--recipe", "llama3-8b", "--gpus", "8", "--nodes", "2"],
                         env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "inter-node traffic per step, per node" in two.stdout and "time (16 GPUs on 2 nodes)" in two.stdout
    capsys.readouterr()
    from fault_helpers import assert_one_line_error, run_cli

    for flag, value, needle in (("--gpus", "0", "an integer >= 1"), ("--mfu", "1.5", "> 0 and <= 1"),
                                ("--reserve", "1", ">= 0 and < 1"), ("--tokens", "-5", ">= 1"),
                                ("--gpu-mem-gb", "nan", "a finite number > 0"), ("--cuda-context-gb", "-1", ">= 0")):
        code, _, err = run_cli(main, ["--recipe", "llama3-8b", flag, value], capsys)  # issue 28 item 12
        assert_one_line_error(code, err, f"argument {flag}: {value}: expected", needle)
    assert main(["--recipe", "llama3-8b", "train.nope=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: unknown recipe key 'train.nope'") and not any("Traceback" in e for e in err)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--gpu-mem-gb" in capsys.readouterr().out


def test_json_output_is_only_json_and_deepspeed_logs_go_to_stderr():
    """Issue 28 item 2: DeepSpeed's "Setting accelerator to CPU" warning (printed at import) must not precede the JSON."""
    proc = subprocess.run([sys.executable, "-m", "train.plan", "--recipe", "llama3-8b", "--json"],
                          env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)  # the whole of stdout parses
    assert plan["fits"] in (True, False) and plan["memory"]["token-loss logits"] > 0
    assert "accelerator" in proc.stderr  # the library's line still reaches the user, on stderr


def test_training_prints_the_plan_first(tmp_path):
    """Rank 0 prints the plan at the start of every run (here: host mode, one CPU process)."""
    from test_train_helpers import overrides, save_target, write_cache

    target = save_target(tmp_path / "target")
    cache = write_cache(tmp_path / "cache", target, n=16)
    cmd = [sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(target, tmp_path / "run", f"train.cache_dir={cache}", steps=1)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan for recipe tiny: 1 CPU process (host mode" in proc.stdout and "head activations" in proc.stdout
    assert proc.stdout.index("plan for recipe tiny") < proc.stdout.index("summary:")


def _saved_bytes(module, call) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward while `call()` runs."""
    import torch

    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(v for k, v in seen.items() if k not in params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_bytes_are_what_autograd_keeps(dtype):
    """The plan's per-row activation bytes (train/plan.py activation_bytes_per_token, without the backward
    transient) against the tensors autograd really saves in the heads' training forwards, at Llama-3's ratios
    (I = 3.5 H, 4 query heads per kv head) scaled down: EAGLE-2, EAGLE-3 step 1, EAGLE-3 with 7 unrolled steps,
    EAGLE-2 with 3 aligned steps."""
    import torch
    from transformers import AutoConfig

    from conftest import bf16_flash_attention_error
    from eagle.head import UNROLL_ROW_CHUNKS, Eagle3Head, EagleHead, head_config_from_target
    from train.plan import COMPUTE_BYTES, Shape, activation_bytes_per_token

    if dtype == "bfloat16" and bf16_flash_attention_error():
        pytest.skip(bf16_flash_attention_error())
    dt = getattr(torch, dtype)
    cb = COMPUTE_BYTES["bf16" if dtype == "bfloat16" else "fp32"]
    H, I, h, kv, V, B, T = 128, 448, 8, 2, 300, 2, 128
    config = AutoConfig.for_model("llama", hidden_size=H, intermediate_size=I, num_attention_heads=h,
                                  num_key_value_heads=kv, vocab_size=V, num_hidden_layers=4)
    torch.manual_seed(0)
    ids, mask = torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long)

    def shape(kind):
        return Shape(hidden=H, intermediate=I, heads=h, kv_heads=kv, head_dim=H // h, vocab=V, layers=4,
                     max_positions=2048, target_params=0, target_active_params=0, head_trainable=0, head_largest=0,
                     kind=kind)

    def planned(kind, step=1, keys=0.0):
        return activation_bytes_per_token(shape(kind), cb, step, keys) - 2 * I * cb  # without the backward transient

    e2 = EagleHead(head_config_from_target(config)).to(dt)
    e2.embed_tokens.weight.requires_grad_(False)
    got = _saved_bytes(e2, lambda: e2(torch.randn(B, T, H, dtype=dt), ids, mask))
    assert got == pytest.approx(B * T * planned("eagle2"), rel=0.03)

    e3 = Eagle3Head(head_config_from_target(config, kind="eagle3", aux_layers=[1, 2, 3], draft_vocab_size=100)).to(dt)
    e3.embed_tokens.weight.requires_grad_(False)
    aux = torch.randn(B, T, 3 * H, dtype=dt)
    one = _saved_bytes(e3, lambda: e3(aux, ids, mask, steps=1))
    assert one == pytest.approx(B * T * planned("eagle3"), rel=0.03)
    rows = torch.arange(0, T, 8)
    seven = _saved_bytes(e3, lambda: e3(aux, ids, mask, steps=7, rows=rows))
    keys = T * (1 + 1 / UNROLL_ROW_CHUNKS) / 2
    later = sum(B * rows.numel() * planned("eagle3", j, keys) for j in range(2, 8))
    later += B * T * 2 * kv * (H // h) * cb  # the unroll's contiguous copy of the step-1 keys and values
    assert seven - one == pytest.approx(later, rel=0.05)

    # P-EAGLE: its parallel positions >= 2 (mask inputs) are counted by EAGLE-3's formulas (train/head_kinds.py)
    from eagle.peagle import PeagleHead
    pe = PeagleHead(head_config_from_target(config, kind="peagle", aux_layers=[1, 2, 3], draft_vocab_size=100)).to(dt)
    pe.embed_tokens.weight.requires_grad_(False)
    pe_one = _saved_bytes(pe, lambda: pe(aux, ids, mask, steps=1))
    assert pe_one == pytest.approx(B * T * planned("peagle"), rel=0.03)
    pe_seven = _saved_bytes(pe, lambda: pe(aux, ids, mask, steps=7, rows=rows))
    later = sum(B * rows.numel() * planned("peagle", j, keys) for j in range(2, 8))
    later += B * T * 2 * kv * (H // h) * cb
    assert pe_seven - pe_one == pytest.approx(later, rel=0.05)

    # EAGLE-2 with multi-step alignment (head.align_steps): the same accounting for its steps >= 2
    feats = torch.randn(B, T, H, dtype=dt)
    plain = _saved_bytes(e2, lambda: e2(feats, ids, mask, steps=1))
    three = _saved_bytes(e2, lambda: e2(feats, ids, mask, steps=3, rows=rows))
    later = sum(B * rows.numel() * planned("eagle2", j, keys) for j in range(2, 4)) + B * T * 2 * kv * (H // h) * cb
    assert three - plain == pytest.approx(later, rel=0.05)

def test_plan_never_builds_the_default_target_and_says_what_it_assumed(tmp_path, monkeypatch, capsys):
    """Issue 28 items 3-4: `train.plan --recipe tiny` before the default target exists plans from its build recipe
    (nothing is built or written), counts the default target's own conversations, and prints its assumptions."""
    from fault_helpers import run_cli
    from train.plan import main

    home = tmp_path / "eagle_home"
    monkeypatch.setenv("EAGLE_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(main, ["--recipe", "tiny", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert not any(tmp_path.iterdir()), f"the plan wrote {list(tmp_path.iterdir())}"  # no target build, no run folder
    assert plan["shape"]["vocab"] == 1024 and plan["shape"]["hidden"] == 64  # data_prep/default_target.py's preset
    said = " | ".join(plan["assumptions"])
    assert "not built yet" in said and "conversations of the embedded default target" in said
    assert "68,000" not in said  # not ShareGPT's size
    assert "data prep: regenerate replies" in plan["time_s"]
    code, out, err = run_cli(main, ["--recipe", "tiny"], capsys)
    assert code == 0 and "0.0 min" not in out and "0.00B" not in out and "assumed: target shape:" in out


def test_plan_without_a_data_source_plans_no_data_prep(tmp_path, capsys):
    """A recipe whose cache another builder makes (stories260k: train.corpus_cache) gets no invented record count
    and no regeneration estimate; --tokens supplies the size."""
    from fault_helpers import run_cli
    from test_train_helpers import save_target
    from train.plan import main

    target = save_target(tmp_path / "target")
    args = ["--recipe", "tiny", f"target.path={target}", f"output_dir={tmp_path / 'run'}", "--json"]
    code, out, err = run_cli(main, args, capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["disk"] == {} and plan["time_s"] == {}
    assert any("data.source is empty" in a and "--tokens" in a for a in plan["assumptions"])
    code, out, err = run_cli(main, [*args, "--tokens", "1000"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["disk"]["feature cache bfloat16 (recipe)"] > 0
    assert "data prep: regenerate replies" not in plan["time_s"] and "training" in plan["time_s"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [("head.aux_layers=[1,2,99]", "head.aux_layers"),
                                           ("head.draft_vocab_size=999999", "head.draft_vocab_size")])
def test_plan_and_training_refuse_the_same_head_keys(override, key, tmp_path, capsys):
    """Issue 28 item 13: one check of the target-dependent head keys (recipes.head.check_head_fits_target), run by the
    plan and by training (train/head_kinds.py: training_kind) alike."""
    from fault_helpers import assert_one_line_error, run_cli
    from recipes import RecipeError
    from test_train_helpers import save_target
    from train.head_kinds import training_kind
    from train.plan import main, target_config

    target = save_target(tmp_path / "target", num_layers=8)  # default aux layers (2, 4, 5): 2 layers have none
    args = [f"target.path={target}", f"output_dir={tmp_path / 'run'}", "head.kind=eagle3", override]
    code, out, err = run_cli(main, ["--recipe", "tiny", *args], capsys)
    line = assert_one_line_error(code, err, key)
    cfg = load_config("tiny", args)
    with pytest.raises(RecipeError) as e:
        training_kind(cfg, target_config(cfg)[0])
    assert str(e.value) == line.removeprefix("error: ")


def test_plan_reads_the_cache_parts_not_the_derived_manifest(tmp_path, capsys):
    """Issue 28 item 16: manifest.json is a derived summary nothing reads: a hand-edited one changes no plan."""
    from fault_helpers import run_cli
    from test_train_helpers import save_target, write_cache
    from train.plan import main

    target = save_target(tmp_path / "target")
    cache = write_cache(tmp_path / "cache", target, n=12)
    args = ["--recipe", "tiny", f"target.path={target}", f"train.cache_dir={cache}", "--json"]
    code, out, err = run_cli(main, args, capsys)
    assert code == 0, err
    before = json.loads(out)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest.update(num_records=999999, num_tokens=10**9, hidden_size=4096)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(main, args, capsys)
    assert code == 0 and json.loads(out)["disk"] == before["disk"]
    assert any("12 records" in a for a in before["assumptions"])


def test_deepspeeds_scheduler_start_warning_is_dropped(caplog):
    """DeepSpeed's WarmupLR warns from its own constructor on every run; with DeepSpeed's lines on stderr it would sit
    beside a command's one `error:` line (train.distributed.import_deepspeed filters exactly that message)."""
    import logging

    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR
    from train.distributed import import_deepspeed

    import_deepspeed()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ds_logger = logging.getLogger("DeepSpeed")  # it does not propagate: listen on it directly
    ds_logger.addHandler(caplog.handler)
    try:
        WarmupLR(opt, warmup_num_steps=10)
        ds_logger.warning("another DeepSpeed warning")
    finally:
        ds_logger.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["another DeepSpeed warning"], messages


# ----------------------------------------------------------------------------- options that size memory, checked
def test_an_unrolled_step_count_that_does_not_fit_is_refused_with_the_largest_that_fits():
    """Issue 35: an EAGLE-3 run of 7 training-time-test steps on 8 x 16 GB GPUs (the plan's peak at the data's longest
    records over the budget) is refused before training with one line naming head.ttt_steps and the largest count
    that fits: that count passes the same check and one more does not."""
    from dataclasses import replace

    from train.plan import PlanError, check_run_fits

    cfg = load_config("llama3-8b-eagle3", ["head.ttt_steps=7"])
    s = plan_shape(cfg)
    hw = Hardware(gpus=8, gpu_mem_gb=16)
    longest = 2048  # the data's longest record
    with pytest.raises(PlanError) as e:
        check_run_fits(cfg, hw, s, longest, "head.ttt_steps", "head.ttt_row_stride")
    msg = str(e.value)
    assert msg.startswith("head.ttt_steps=7 does not fit in memory: the plan (train/plan.py) needs ")
    mb = cfg.train.micro_batch_size
    assert f"per GPU at micro-batch {mb} x 2048 tokens (the longest training record), 14.40 GB usable" in msg
    assert "raise head.ttt_row_stride (now 1)" in msg and "train.check_memory=false starts it anyway" in msg
    bound = int(msg.split("at most head.ttt_steps=")[1].split()[0])
    assert 1 <= bound < 7
    check_run_fits(cfg, hw, replace(s, ttt_steps=bound), longest, "head.ttt_steps")  # the bound fits
    with pytest.raises(PlanError, match=f"head.ttt_steps={bound + 1} does not fit"):
        check_run_fits(cfg, hw, replace(s, ttt_steps=bound + 1), longest, "head.ttt_steps")
    # the data's records bound the micro-batch: the same steps over records of 256 tokens fit
    check_run_fits(cfg, hw, s, 256, "head.ttt_steps")
    # the plan is an estimate: train.check_memory=false starts the run anyway
    check_run_fits(load_config("llama3-8b-eagle3", ["head.ttt_steps=7", "train.check_memory=false"]), hw, s, longest,
                   "head.ttt_steps")


def test_a_run_that_does_not_fit_at_one_step_names_the_plans_knobs(llama_shape):
    """Nothing to lower in the step count (EAGLE-2 without alignment): the line names the settings that each alone
    bring the plan under the budget (`suggest`)."""
    from train.plan import PlanError, check_run_fits

    cfg = load_config("llama3-8b", ["train.loss_chunk=0"])
    with pytest.raises(PlanError) as e:
        check_run_fits(cfg, Hardware(gpus=8, gpu_mem_gb=16), llama_shape, 2048, "head.align_steps")
    msg = str(e.value)
    assert msg.startswith("this run does not fit in memory: the plan (train/plan.py) needs ")
    assert "set train.loss_chunk=256" in msg and "train.check_memory=false" in msg
