"""The ``layertap`` command line: extract, verify, demo, tiny-model, text-view."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from layertap.cli_audit import register_audit_command
from layertap.cli_jobs import register_job_commands
from layertap.device import DEVICE_HELP
from layertap.engines.factory import hf_engine_factory, sglang_engine_factory
from layertap.errors import LayertapError
from layertap.logs import configure_logging, level_for
from layertap.spec import (
    ANY_AUX_HELP,
    DEFAULT_MAX_BAD_ROWS,
    MAX_BAD_ROWS_HELP,
    STORE_DTYPE_HELP,
    STORE_DTYPES,
    ExtractionSpec,
    parse_layer_list,
)
from layertap.trainers import GUIDE

console = Console(stderr=True)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}")  # server log lines hold [brackets]
    sys.exit(2)


@click.group()
@click.option("-v", "--verbose", count=True, help="Log more: -v info (what a run decides), -vv debug.")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Extract intermediate hidden states for speculative-decoding drafter training."""
    ctx.obj = verbose
    configure_logging(level_for(verbose))


def _quiet_libraries() -> None:
    """Our progress bar is the one to watch: silence transformers/datasets bars and warnings (called by the
    commands that load models, so that light commands like ``status`` start fast)."""
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


@main.command()
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True)
@click.option(
    "--data", type=click.Path(path_type=Path), required=True, help="JSONL, JSON, Parquet or save_to_disk folder."
)
@click.option("--layers", required=True, help="Comma-separated layer ids, e.g. 3,31,59.")
@click.option(
    "--layer-convention",
    type=click.Choice(["capture", "sglang-eagle3", "vllm"]),
    default="capture",
    show_default=True,
    help="capture: id i = input of layer i (HF output_hidden_states[i]).",
)
@click.option(
    "--final", type=click.Choice(["post", "pre", "both"]), default=None, help="Default: what the format needs."
)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option(
    "--format", "fmt", type=click.Choice(["specforge", "speculators"]), default="specforge", show_default=True
)
@click.option(
    "--store-dtype", type=click.Choice(STORE_DTYPES), default="bfloat16", show_default=True, help=STORE_DTYPE_HELP
)
@click.option("--max-length", type=int, default=None, help="Tokens per row at most; not above the model's context.")
@click.option("--overlong", type=click.Choice(["truncate", "skip"]), default="truncate", show_default=True)
@click.option("--allow-any-aux-layers", is_flag=True, help=ANY_AUX_HELP)
@click.option("--max-bad-rows", default=DEFAULT_MAX_BAD_ROWS, show_default=True, help=MAX_BAD_ROWS_HELP)
@click.option("--engine", type=click.Choice(["hf", "sglang"]), default="hf", show_default=True)
@click.option("--server-url", default=None, help="sglang: attach to this capture server instead of launching one.")
@click.option(
    "--dump-root",
    type=click.Path(path_type=Path),
    default=None,
    help="sglang: where the plugin writes dumps (must be the server's view). On the output's filesystem "
    "(the default), commits are renames; elsewhere they copy each file once.",
)
@click.option("--in-flight", type=int, default=16, show_default=True, help="sglang: requests in flight.")
@click.option(
    "--sglang-python",
    type=click.Path(path_type=Path),
    default=Path("python3"),
    show_default=True,
    help="sglang: the python of the server's own environment.",
)
@click.option("--sglang-args", default="", help="sglang: extra server flags, shell-quoted (e.g. '--tp-size 8').")
@click.option(
    "--allow-dummy-weights",
    is_flag=True,
    help="sglang: accept a server making random weights (--load-format dummy), for benchmarks; the manifest says so.",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Run the Python code the model folder ships (Kimi-K2.5's tokenizer is code). Read it first.",
)
@click.option("--device", default="cpu", show_default=True, help=f"HF engine: {DEVICE_HELP}.")
@click.option("--batch-tokens", type=int, default=8192, show_default=True, help="HF engine: padded tokens per batch.")
@click.option(
    "--dtype",
    "compute_dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default=None,
    help="HF engine: the dtype the model computes in (default: the folder's own; a server takes --sglang-args "
    "'--dtype ...').",
)
@click.option(
    "--resume-check",
    type=click.Choice(["full", "quick"]),
    default="full",
    show_default=True,
    help="How committed samples are re-checked before being skipped (full re-hashes every file).",
)
def extract(
    model,
    data,
    layers,
    layer_convention,
    final,
    out,
    fmt,
    store_dtype,
    max_length,
    overlong,
    allow_any_aux_layers,
    max_bad_rows,
    engine,
    server_url,
    dump_root,
    in_flight,
    sglang_python,
    sglang_args,
    allow_dummy_weights,
    trust_remote_code,
    device,
    batch_tokens,
    compute_dtype,
    resume_check,
) -> None:
    """Run (or resume) an extraction into OUT; exit 1 when it stored nothing or more rows were bad than
    --max-bad-rows allows (2 when it could not run)."""
    _quiet_libraries()
    from layertap.pipeline import run_extraction
    from layertap.progress import RichProgress

    try:
        spec = ExtractionSpec(
            model=model,
            data=data,
            layers=parse_layer_list(layers),
            layer_convention=layer_convention,
            final=final,
            format=fmt,
            store_dtype=store_dtype,
            max_length=max_length,
            overlong=overlong,
            trust_remote_code=trust_remote_code,
            allow_any_aux_layers=allow_any_aux_layers,
            max_bad_rows=max_bad_rows,
        )
    except ValidationError as exc:  # one line per problem, without pydantic's decoration
        _fail("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()))
    except LayertapError as exc:
        _fail(str(exc))
    if compute_dtype and engine != "hf":
        _fail("--dtype is the HF engine's; a server computes in what --sglang-args '--dtype ...' says")
    progress = RichProgress(console)
    try:
        if engine == "hf":
            factory = hf_engine_factory(model, device, batch_tokens, compute_dtype)
        else:
            factory = sglang_engine_factory(model, out, spec.format, server_url, dump_root, in_flight, sglang_python,
                                            sglang_args, trust_remote_code, allow_dummy_weights,
                                            spec.store_dtype)  # fmt: skip
        report = run_extraction(spec, out, factory, progress=progress, check_level=resume_check)
    except LayertapError as exc:
        _fail(str(exc))
    finally:
        progress.stop()
    console.print(
        f"[green]done[/]: {len(report.computed)} samples computed, {report.already_done} already done"
        f" ({len(report.redone)} redone after failing checks, {len(report.changed)} recomputed because their rows"
        f" changed), {report.tokens:,} tokens in {report.seconds:.1f}s;"
        f" {report.row_errors} bad rows, {report.skipped_overlong} skipped as too long, {report.truncated} truncated,"
        f" {report.failed} failed captures. Output: {out}"
    )
    ok, verdict = report.verdict(spec.max_bad_rows)
    if not ok:
        console.print(f"[bold red]failed:[/] {escape(verdict)}")
        sys.exit(1)
    if verdict:
        console.print(f"[yellow]warning:[/] {escape(verdict)}")
    click.echo((out / GUIDE).read_text())


@main.command()
@click.argument("out", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--quick", is_flag=True, help="Skip re-hashing and finiteness checks.")
@click.option("--rewrite-token-freq", is_flag=True, help="Derive token_freq.pt again from the stored samples.")
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    default=None,
    help="Also check every stored sample against this dataset, re-tokenized as the store's run did.",
)
@click.option("--trust-remote-code", is_flag=True, help="With --data: run the tokenizer code the model folder ships.")
def verify(out: Path, quick: bool, rewrite_token_freq: bool, data: Path | None, trust_remote_code: bool) -> None:
    """Re-read every sample in OUT and report problems (exit 1 if any); print and rewrite OUT/TRAIN.md."""
    from layertap.verify import verify_store

    if data is not None:
        _quiet_libraries()
    try:
        report = verify_store(out, "quick" if quick else "full", rewrite_token_freq=rewrite_token_freq, data=data,
                              trust_remote_code=trust_remote_code)  # fmt: skip
    except LayertapError as exc:
        _fail(str(exc))
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    for p in report.problems:
        console.print(f"[red]problem:[/] {p}")
    if report.guide is not None:
        click.echo(report.guide)
    status = "[green]clean[/]" if report.ok else f"[red]{len(report.problems)} problems[/]"
    console.print(
        f"verify {out}: {report.samples} samples, {report.tokens:,} tokens, {report.nbytes:,} bytes: {status}"
    )
    sys.exit(0 if report.ok else 1)


@main.command("tiny-model")
@click.option("--arch", type=click.Choice(["llama", "kimi-k2", "kimi-k2.5"]), default="llama", show_default=True)
@click.option(
    "--shape",
    type=click.Choice(["tiny", "mla-gpu", "kimi-k2-width", "seed-depth"]),
    default="tiny",
    show_default=True,
    help="DeepseekV3 archs: tiny (CPU tests), mla-gpu (Kimi's MLA head sizes, which GPU kernels need; "
    "hidden 1024), kimi-k2-width (hidden 7168, 4 layers, 16 experts top-8), seed-depth (Kimi-K2.5's 61 layers "
    "at hidden 7168, 8 experts top-8 + 1 shared: Kimi's work per token; use with --config-only).",
)
@click.option(
    "--config-only",
    is_flag=True,
    help="kimi-k2.5: no weight files; SGLang serves the folder with --load-format dummy (benchmarks only).",
)
@click.option(
    "--quantize",
    type=click.Choice(["int4"]),
    default=None,
    help="kimi-k2.5: the released INT4 folder (routed experts compressed-tensors pack-quantized, the rest bf16 "
    "whatever --dtype says, one shard per layer).",
)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.argument("out", type=click.Path(path_type=Path))
def tiny_model(arch: str, shape: str, config_only: bool, quantize: str | None, dtype: str, seed: int,
               out: Path) -> None:  # fmt: skip
    """Build a deterministic tiny random-weight model (with tokenizer and chat template) in OUT."""
    import torch

    from layertap.tiny.build import build_tiny_model

    try:
        built = build_tiny_model(
            arch, out, seed=seed, dtype=getattr(torch, dtype), shape=shape, config_only=config_only, quantize=quantize
        )
    except ValueError as exc:
        _fail(str(exc))
    what = "config-only folder (no weights: serve it with --load-format dummy)" if config_only else "tiny model"
    weights = "INT4 routed experts, the rest bfloat16" if quantize else dtype
    console.print(f"built {arch} ({shape}, {weights}) {what} in {built}")


@main.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("demo-output"), show_default=True)
@click.option(
    "--format", "fmt", type=click.Choice(["specforge", "speculators"]), default="specforge", show_default=True
)
def demo(out: Path, fmt: str) -> None:
    """Build a tiny model and a small conversation set, extract, verify, and show the result."""
    _quiet_libraries()
    from layertap.demo import run_demo

    try:
        run_demo(out, fmt, console)
    except LayertapError as exc:
        _fail(str(exc))


@main.command("text-view")
@click.argument("model", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("out", type=click.Path(path_type=Path))
def text_view(model: Path, out: Path) -> None:
    """Make OUT a text-only view of wrapper folder MODEL (Kimi-K2.5) for trainers that cannot take the wrapper:
    config.json is its text_config, the weights are its shards by symlink (nothing copied). TRAIN.md says when."""
    from layertap.models.text_view import write_text_view

    try:
        console.print(f"text-only view of {model} in {write_text_view(model, out)}")
    except LayertapError as exc:
        _fail(str(exc))


register_job_commands(main)
register_audit_command(main)
