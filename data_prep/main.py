"""Data preparation, driven by a recipe: load -> regenerate -> tokenize -> cache.

    python data_prep/main.py --recipe tiny [key=value ...] [all|load|regenerate|tokenize|cache|inspect]
                             [--shard i/n] [--inspect N]

Outputs go to ``{output_dir}/data/``:
    conversations.jsonl, rejects.jsonl, load_report.json     validated, normalised input
    regenerated/part-*.jsonl (+ settings.json)              target-regenerated conversations (resumable)
    tokenized.jsonl, tokenize_rejects.jsonl, tokenize_report.json
    features/                                                the feature cache (data_prep.feature_cache)
    report.json                                              every stage's counts and throughput

Several processes: `torchrun --nproc_per_node N data_prep/main.py ...` (ranks share the work and wait
for each other between stages), or independent jobs with `--shard i/n` (each does its share of
regenerate/cache; tokenize runs once all regeneration shards are done).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

if not __package__:  # started by path (deepspeed, torchrun: once per rank): the repo root replaces this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch.distributed as dist
from huggingface_hub.utils import disable_progress_bars

from data_prep.assistant_spans import count_labels, label_tokens, renders_reasoning
from data_prep.cache_features import cache_shard, check_disk
from data_prep.chat_template import stop_token_ids
from data_prep.conversations import load_conversations, read_jsonl, write_jsonl
from data_prep.feature_cache import CACHE_MANIFEST, FeatureCacheWriter, merge_manifests, sha256_file
from data_prep.feature_layers import feature_layers
from data_prep.loss_mask import render_masked, tokenize_records
from data_prep.regenerate import (GenerationSettings, HFBackend, OpenAIBackend, ServerError, check_settings,
                                  read_parts, regenerate_shard)
from data_prep.target import (load_target_config, load_target_model, load_target_tokenizer, quantization_meta,
                              resolve_target_path, served_target_folder, target_config_hash)
from data_prep.tokenized import load_tokenized, write_tokenized
from data_prep.tool_calls import tool_call_format
from data_prep.vllm_features import (UNREQUESTED, cache_shard_vllm, capture_layer_ids,
                                     capture_work_dir, staging_bytes_per_token)
from eagle.cli_errors import ArgumentParser, bounded, one_line_errors
from eagle.device import pick_device
from eagle.head_kinds import text_config
from eagle.hub_ids import check_local_exists
from eagle.run_lock import run_lock
from eagle.state_files import StateFile, read_json_state, register, write_json_state
from engine.engine_process import resolve_engine_python
from engine.quantized_target import served_label
from engine.vllm_server import VLLMServer, capture_args, serve_args
from recipes import add_print_config, command_config, layout

STAGES = ("all", "load", "regenerate", "tokenize", "cache", "inspect")


# --------------------------------------------------------------------------- run context
DATA_REPORT = register(StateFile(
    "report.json", "OUTPUT_DIR/data", writer="data_prep/main.py", schema={"*": dict},
    rebuild="delete it and rerun data_prep (each stage writes its numbers into it again)",
    when_missing="no stage has reported yet", example={"load": {"kept": 3}}))


class Run:
    """The recipe, the data directory and this process's shard."""

    def __init__(self, cfg, shard: int, num_shards: int, distributed: bool, progress: bool):
        self.cfg = cfg
        self.data_dir = layout.data_dir(cfg)
        self.shard, self.num_shards = shard, num_shards
        self.distributed = distributed
        self.progress = progress
        self._tokenizer = None
        self._model = None
        self.server = None  # the one vLLM server regenerating AND capturing (`shared_server`), once started

    @property
    def is_main(self) -> bool:
        return self.shard == 0 or not self.distributed

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_target_tokenizer(self.cfg.target)
        return self._tokenizer

    def model(self):
        if self._model is None:
            self._model = load_target_model(self.cfg.target, pick_device(self.cfg.data.device))
        return self._model

    def log(self, msg: str) -> None:
        prefix = f"[data_prep {self.shard}/{self.num_shards}]" if self.num_shards > 1 else "[data_prep]"
        print(f"{prefix} {msg}", flush=True)

    def update_report(self, key: str, value: dict) -> None:
        """Merge one stage's numbers into report.json (per-shard keys avoid races between ranks)."""
        path = self.data_dir / DATA_REPORT.name
        report = read_json_state(path, DATA_REPORT) or {}
        report[key] = value
        write_json_state(path, report, DATA_REPORT)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return i, n


# --------------------------------------------------------------------------- stages
def stage_load(run: Run) -> list[dict]:
    d = run.cfg.data
    result = load_conversations(d.source, d.format, d.max_records, d.system_prompt, d.hf_subset, d.hf_split)
    report = result.report(d.source)
    if run.is_main:  # with --shard every job writes the same content (atomic replace)
        if result.kept:  # a source with no valid record never replaces the conversations of an earlier run
            write_jsonl(run.data_dir / "conversations.jsonl", result.kept)
        write_jsonl(run.data_dir / "rejects.jsonl", result.rejects)
        (run.data_dir / "load_report.json").write_text(json.dumps(report, indent=1))
        run.update_report("load", report)
    run.log(f"load {d.source}: kept {report['kept']} + rejected {report['rejected']} = input {report['input']}"
            + (f"  reasons {report['reject_reasons']} (see {run.data_dir / 'rejects.jsonl'})" if report["rejected"] else ""))
    if not result.kept:
        raise SystemExit(f"no valid conversation in {d.source}; see {run.data_dir / 'rejects.jsonl'}")
    return result.kept


def generation_settings(run: Run):
    d = run.cfg.data
    return GenerationSettings(max_new_tokens=d.max_new_tokens, do_sample=d.do_sample, temperature=d.temperature,
                              top_p=d.top_p, seed=run.cfg.seed)


def make_backend(run: Run, api_base: str | None = None):
    d = run.cfg.data
    settings = generation_settings(run)
    if d.backend == "hf":
        model, tok = run.model(), run.tokenizer()
        stops = sorted(set(stop_token_ids(tok, model.generation_config, run.cfg.target.chat_template))
                       | {int(i) for i in d.extra_stop_ids})
        return HFBackend(model, tok, settings, stops, max_prompt_tokens=d.max_length)
    if d.backend == "openai":  # the same prompts, stop ids and prompt-length rule as the hf backend
        # lazy: transformers costs over a second at import; only the openai backend's stop ids need it here
        from transformers import GenerationConfig

        path, tok = resolve_target_path(run.cfg.target), run.tokenizer()
        try:
            gen_config = GenerationConfig.from_pretrained(path, revision=run.cfg.target.revision)
        except OSError:  # no generation_config.json
            gen_config = None
        stops = sorted(set(stop_token_ids(tok, gen_config, run.cfg.target.chat_template))
                       | {int(i) for i in d.extra_stop_ids})
        return OpenAIBackend(api_base or d.api_base, d.api_model or path, settings,
                             api_key=os.environ.get(d.api_key_env), timeout_s=d.api_timeout_s, retries=d.api_retries,
                             concurrency=d.gen_batch_size, endpoint=d.api_endpoint, tokenizer=tok, stop_ids=stops,
                             max_prompt_tokens=d.max_length, token_ids=d.api_token_ids)
    raise ValueError(f"data.backend must be 'hf' or 'openai', got {d.backend!r}")


def shares_server(cfg) -> bool:
    """data.backend=openai data.serve=true data.feature_source=vllm: ONE vLLM server, started by this process when
    the first stage needs it and stopped at its end, regenerates the answers and captures the cache's states."""
    d = cfg.data
    return d.backend == "openai" and bool(d.serve) and d.feature_source == "vllm"


def recipe_server(cfg, target_path: str, served_model_name: str, work: Path, log_path: Path,
                  capture: tuple[list[int], Path] | None = None) -> VLLMServer:
    """The server `data.serve` starts for regeneration: the target (padded when vLLM's CPU attention needs it),
    `serve_args` with a context of data.max_length + data.max_new_tokens (capped at the target's
    max_position_embeddings), then data.serve_args. `capture` (hidden-state ids, capture folder): the same server
    also captures those states for the cache stage (`capture_args`)."""
    d = cfg.data
    engine_python = resolve_engine_python(d.engine_python)
    config = load_target_config(target_path)
    model = served_target_folder(cfg.target, target_path, config, work)
    limit = int(getattr(text_config(config), "max_position_embeddings", 0) or 0)
    context = d.max_length + d.max_new_tokens
    args = serve_args(cfg.target.dtype, cfg.seed, min(context, limit) if limit else context, cfg.target.chat_template,
                      work)
    if capture is not None:
        args += capture_args(*capture)
    return VLLMServer(engine_python, model, log_path, served_model_name=served_model_name,
                      args=args + [str(a) for a in d.serve_args])


def shared_server(run: Run):
    """The running regenerate-and-capture server (`shares_server`), started on the first call: the recipe's
    regeneration server (`recipe_server`) with the cache's hidden-state ids captured (`capture_args`)."""
    if run.server is None:
        path = resolve_target_path(run.cfg.target)
        config = load_target_config(path, run.cfg.target.revision)
        layer_ids = capture_layer_ids(feature_layers(run.cfg.head, config), int(text_config(config).num_hidden_layers))
        name = f"shard{run.shard}of{run.num_shards}"
        log_path = run.data_dir / f"vllm_server_{name}.log"
        run.log(f"starting vLLM for {path}, regenerating and capturing hidden states {layer_ids} (log {log_path}); "
                "importing vllm takes minutes")
        server = recipe_server(run.cfg, path, run.cfg.data.api_model or path, run.data_dir / "served_target",
                               log_path, capture=(layer_ids, capture_work_dir(run.data_dir, run.shard) / UNREQUESTED))
        run.server = server.__enter__()  # started and ready (stopped on a failed start); run_stages stops it
    return run.server


def regeneration_server(run: Run):
    """data.serve: the vLLM server this process starts for its regeneration (a context manager), else a null one;
    with `shares_server` the run's one server, left running for the cache stage."""
    if not run.cfg.data.serve:
        return contextlib.nullcontext()
    if shares_server(run.cfg):
        return contextlib.nullcontext(shared_server(run))
    path = resolve_target_path(run.cfg.target)
    name = f"shard{run.shard}of{run.num_shards}"
    run.log(f"starting vLLM for {path} (log {run.data_dir / f'vllm_server_{name}.log'}); importing vllm takes minutes")
    return recipe_server(run.cfg, path, run.cfg.data.api_model or path, run.data_dir / "served_target",
                         run.data_dir / f"vllm_server_{name}.log")


def call_format(run: Run):
    """The tool-call markup of the target's template (data.tool_call_format; auto: read from the template)."""
    return tool_call_format(run.cfg.data.tool_call_format, run.tokenizer().chat_template)


def stage_regenerate(run: Run, conversations: list[dict]) -> None:
    d = run.cfg.data
    out = layout.regenerated_dir(run.cfg)
    calls = call_format(run)
    settings = {"target": run.cfg.target.path, "chat_template": run.cfg.target.chat_template, "backend": d.backend,
                "max_length": d.max_length, "extra_stop_ids": [int(i) for i in d.extra_stop_ids],
                **asdict(generation_settings(run))}
    if calls.name != "none":  # how replies were parsed; absent for templates without tool calls (as before it existed)
        settings["tool_call_format"] = calls.name
    settings.update(quantization_meta(run.cfg.target))  # replies of a quantized target are another dataset
    if d.serve and served_label(run.cfg.target.quantization):  # vLLM regenerates from the dequantized float copy
        settings["served_target"] = served_label(run.cfg.target.quantization)
    check_settings(out, settings)
    with regeneration_server(run) as server:
        try:
            stats = regenerate_shard(conversations, make_backend(run, server.url if server else None), out, run.shard,
                                     run.num_shards, d.gen_batch_size, run.cfg.seed, progress=run.progress,
                                     calls=calls, think=renders_reasoning(run.tokenizer().chat_template))
        except ServerError as e:
            died = server.died() if server else None
            if died:  # the requests failed because the server is gone: say that, not "connection refused"
                raise ServerError(f"{died}; finished records are kept: rerun the same command to resume") from None
            raise ServerError(f"{e}; finished records are kept: rerun to resume") from None
    s = stats.as_dict()
    run.update_report(f"regenerate_shard{run.shard}of{run.num_shards}", s)
    run.log(f"regenerate: {s['records_generated']} generated, {s['records_skipped_done']} already done, "
            f"{s['length_limited']} hit max_new_tokens, {s['stopped_at_max_length']} stopped at a prompt too long for "
            f"max_length or the server (kept up to their last reply; with none: rejected into tokenize_rejects.jsonl); "
            + (f"tool results kept {s['tool_results_kept']}, tool exchanges diverged {s['tool_exchanges_diverged']} "
               f"(the target called other functions: the dataset's results dropped), {s['ended_at_unanswered_call']} "
               "ended at a call the dataset has no result for; "
               if s["tool_results_kept"] or s["tool_exchanges_diverged"] or s["ended_at_unanswered_call"] else "")
            + f"{s['records_per_s']:.2f} records/s, {s['tokens_per_s']:.1f} tokens/s")


def regenerated_records(run: Run, conversations: list[dict]) -> tuple[list[dict], list[str]]:
    """Regenerated records in conversation order, and the ids not regenerated yet."""
    done = read_parts(layout.regenerated_dir(run.cfg))
    ordered = [done[c["id"]] for c in conversations if c["id"] in done]
    missing = [c["id"] for c in conversations if c["id"] not in done]
    return ordered, missing


def stage_tokenize(run: Run, conversations: list[dict]) -> None:
    d = run.cfg.data
    if d.regenerate:
        records, missing = regenerated_records(run, conversations)
        if missing:
            raise SystemExit(f"regeneration is incomplete: {len(missing)} of {len(conversations)} conversations missing "
                             f"(e.g. {missing[:3]}); run the regenerate stage for every shard first")
    else:
        records = conversations
    if d.on_length_limit not in ("keep", "drop"):
        raise ValueError(f"data.on_length_limit must be 'keep' or 'drop', got {d.on_length_limit!r}")
    tokenized, stats = tokenize_records(records, run.tokenizer(), d.max_length, d.overlong,
                                        drop_length_limited=d.on_length_limit == "drop",
                                        train_reasoning=d.train_reasoning, calls=call_format(run))
    write_tokenized(run.data_dir / layout.TOKENIZED_FILE, tokenized)
    write_jsonl(run.data_dir / "tokenize_rejects.jsonl", stats.rejects)
    report = stats.report()
    report["length_limited_kept"] = sum(bool(r.get("length_limited")) for r in records) - stats.dropped_length_limited
    (run.data_dir / "tokenize_report.json").write_text(json.dumps(report, indent=1))
    run.update_report("tokenize", report)
    run.log(f"tokenize: {report['accounting']}; truncated {stats.truncated}; {stats.tokens:,} tokens, "
            f"{stats.loss_tokens:,} trained on; reasoning {stats.reasoning_tokens:,} tokens "
            f"({'trained on' if d.train_reasoning else 'not trained on: data.train_reasoning=false'}), tool calls "
            f"{stats.tool_call_tokens:,}" + (f"; {stats.reasoning_not_rendered} turns' reasoning_content not written by "
                                             "the template" if stats.reasoning_not_rendered else ""))
    if not tokenized:
        raise SystemExit(f"no sample left after tokenisation; see {run.data_dir / 'tokenize_rejects.jsonl'}")


def stage_inspect(run: Run, n: int) -> None:
    tok, calls = run.tokenizer(), call_format(run)
    for k, rec in enumerate(load_tokenized(run.data_dir / layout.TOKENIZED_FILE)):
        if k >= n:
            break
        trained = sum(rec["loss_mask"])
        parts = count_labels(label_tokens(tok, rec["input_ids"], rec["loss_mask"], calls))
        print(f"=== {rec['id']}: {len(rec['input_ids'])} tokens, {trained} trained on (highlighted: answer "
              f"{parts['answer']} ⟦⟧, reasoning {parts['reasoning']} ⟪⟫, tool call {parts['tool_call']} ⦃⦄) ===")
        print(render_masked(tok, rec["input_ids"], rec["loss_mask"], calls=calls))
        print()


def stage_cache(run: Run) -> None:
    d = run.cfg.data
    tok_path = run.data_dir / layout.TOKENIZED_FILE
    records = list(load_tokenized(tok_path))
    engine = d.feature_source == "vllm"  # the states computed by vLLM (data_prep/vllm_features.py), not transformers
    config = load_target_config(run.cfg.target.path) if engine else run.model().config
    text = text_config(config)  # multimodal wrappers: the language model's config
    meta = {"target": resolve_target_path(run.cfg.target), "config_hash": target_config_hash(config),
            "hidden_size": int(text.hidden_size), "vocab_size": int(text.vocab_size),
            "target_dtype": run.cfg.target.dtype, "tokenized_sha256": sha256_file(tok_path)}
    meta.update(quantization_meta(run.cfg.target))  # a quantized target's states (none: the legacy meta)
    if engine and served_label(run.cfg.target.quantization):  # vLLM captures them from the dequantized float copy
        meta["served_target"] = served_label(run.cfg.target.quantization)
    layers = feature_layers(run.cfg.head, config)  # None for eagle2: the legacy meta, byte for byte
    if layers is not None:
        meta["feature_layers"] = layers
    out = run.data_dir / layout.FEATURES_DIR
    writer = FeatureCacheWriter(out, meta, dtype=d.cache_dtype, part=f"shard{run.shard:05d}-of-{run.num_shards:05d}",
                                max_shard_bytes=d.cache_shard_mb * 2**20)
    remaining = sum(len(r["input_ids"]) for r in records if r["id"] not in writer)
    staging = remaining * staging_bytes_per_token(meta["hidden_size"], layers) / 1024**3 if engine else 0.0
    check_disk(out, remaining, meta["hidden_size"], d.cache_dtype, d.disk_headroom_gb + staging, layers)
    if engine:
        stats = cache_shard_vllm(run.cfg, meta["target"], config, records, writer, run.shard, run.num_shards, layers,
                                 run.data_dir, server=(lambda: shared_server(run)) if shares_server(run.cfg) else None)
    else:
        stats = cache_shard(run.model(), records, writer, run.shard, run.num_shards, progress=run.progress,
                            layers=layers)
    writer.close()
    s = {**stats.as_dict(), "feature_source": d.feature_source}
    run.update_report(f"cache_shard{run.shard}of{run.num_shards}", s)
    run.log(f"cache: {s['records_cached']} samples cached, {s['records_skipped_done']} already cached; "
            f"{s['records_per_s']:.2f} records/s, {s['tokens_per_s']:.1f} tokens/s")
    run.barrier()
    if run.is_main:
        manifest = merge_manifests(out)
        write_json_state(out / "manifest.json", manifest, CACHE_MANIFEST)
        summary = {k: manifest[k] for k in ("dtype", "num_records", "num_tokens", "num_loss_tokens", "bytes_on_disk",
                                             "bytes_per_token", "reference_bytes_per_token") if k in manifest}
        if "quantization" in manifest:
            summary["quantization"] = manifest["quantization"]
        run.update_report("cache", summary)
        complete = manifest["num_records"] == len(records)
        run.log(f"cache {out}: {manifest['num_records']}/{len(records)} samples, {manifest['num_tokens']:,} tokens, "
                f"{manifest['bytes_per_token']} B/token (reference layout {manifest['reference_bytes_per_token']})"
                + (f", int8 relative RMSE {manifest['quantization']['relative_rmse']:.2e}" if "quantization" in manifest else "")
                + ("" if complete else " -- other shards still pending"))


# --------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="data_prep/main.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name (recipes/NAME.yaml) or path")
    p.add_argument("--shard", type=parse_shard, default=None, help="i/n: do the i-th of n shares of regenerate/cache")
    p.add_argument("--inspect", type=bounded(int, at_least=0), default=0, metavar="N", help="print N tokenised records, trained-on tokens highlighted")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    add_print_config(p)
    p.add_argument("rest", nargs="*", help=f"key=value recipe overrides and at most one stage of {STAGES}")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = [a for a in args.rest if "=" in a]
    stages = [a for a in args.rest if "=" not in a]
    if len(stages) > 1 or (stages and stages[0] not in STAGES):
        raise SystemExit(f"expected at most one stage out of {STAGES} besides key=value overrides, got {stages}")
    stage = stages[0] if stages else "all"
    cfg = command_config(args, overrides)

    distributed = False
    if args.shard is not None:
        shard, num_shards = args.shard
    else:
        shard, num_shards = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if num_shards > 1:
            dist.init_process_group("gloo")
            distributed = True
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_shards)))
    if args.no_progress:  # also the libraries' bars (model loading), so stderr holds only warnings and errors
        # lazy: transformers costs over a second at import; only this flag needs its logging switch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()
    run = Run(cfg, shard, num_shards, distributed, progress=not args.no_progress)
    try:
        with run_lock(run.data_dir, f"shard{shard}of{num_shards}", "data prep"):  # a busy folder: refused at once
            preflight(run, stage)  # the whole run's inputs, before the first stage writes (a failure leaves no folder)
            try:
                run_stages(run, stage, args.inspect)
            finally:
                if run.server is not None:  # the regenerate-and-capture server, whichever stage started it
                    run.server.stop()
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
    return 0


def preflight(run: Run, stage: str) -> None:
    """Check what the stages of this run will read, before any of them writes: the data source (load), the target's
    folder or hub id, its config and its tokenizer with the chat template (every later stage). A bad target.path then
    fails here, not after the load stage has written conversations.jsonl."""
    d = run.cfg.data
    if stage in ("all", "load"):
        if not d.source:
            raise ValueError("data.source is empty: set it to a .json/.jsonl file or a HF dataset id (data.source=...)")
        check_local_exists(str(d.source), "data.source", "a local .json/.jsonl/.parquet/.csv file")
    if stage != "load":
        load_target_config(resolve_target_path(run.cfg.target), run.cfg.target.revision)
        run.tokenizer()


def run_stages(run: Run, stage: str, inspect_n: int) -> None:
    d = run.cfg.data
    conv_path = run.data_dir / "conversations.jsonl"
    if stage in ("all", "load"):
        conversations = stage_load(run)
        run.barrier()
    elif stage in ("regenerate", "tokenize"):
        if not conv_path.exists():
            raise SystemExit(f"{conv_path} not found: run the load stage first")
        conversations = read_jsonl(conv_path)

    if stage == "regenerate" or (stage == "all" and d.regenerate):
        stage_regenerate(run, conversations)
        run.barrier()

    if stage == "all" and d.regenerate and not run.distributed and run.num_shards > 1:
        _, missing = regenerated_records(run, conversations)
        if missing:
            run.log(f"shard done; {len(missing)} conversations still pending in other shards. Once all shards finish, "
                    "run the `tokenize` stage once, then `cache --shard i/n` per shard")
            return

    if stage in ("all", "tokenize"):
        if run.is_main:
            stage_tokenize(run, conversations)
        run.barrier()

    if inspect_n or stage == "inspect":
        if run.is_main:
            stage_inspect(run, inspect_n or 3)

    if stage == "cache" or (stage == "all" and d.cache_features):
        stage_cache(run)


if __name__ == "__main__":
    sys.exit(main())
