"""The ``layertap`` command line: extract, verify, stream-verify, demo, tiny-model, text-view."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.markup import escape

from layertap.cli_audit import register_audit_command
from layertap.cli_base import Exit, console, fail, failing_on_errors, key_prefix_option, model_options, model_values
from layertap.cli_jobs import register_job_commands
from layertap.engines.factory import hf_engine_factory, sglang_engine_factory
from layertap.logs import configure_logging, level_for
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec
from layertap.trainers import GUIDE

if TYPE_CHECKING:
    from layertap.stream.sink import MooncakeSink
    from layertap.verify import VerifyReport

STREAM_ADDRESSES = ("mooncake_master", "stream_redis_url")  # the run settings a stream's consumer takes too


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
@model_options(ExtractionSpec)
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="The store: a new folder, or the one to resume."
)
@model_options(RunSettings)
def extract(out: Path, **options: Any) -> None:
    """Run (or resume) an extraction into OUT; exit 1 when it stored nothing or more rows were bad than
    --max-bad-rows allows (2 when it could not run)."""
    _quiet_libraries()
    import time

    from layertap.pipeline import ProgressEvents, Run, StageTimes
    from layertap.progress import RichProgress

    started, stages = time.monotonic(), StageTimes()
    with failing_on_errors():
        spec = ExtractionSpec(**model_values(ExtractionSpec, options))
        settings = RunSettings(**model_values(RunSettings, options))
        dumps = None
        if settings.engine == "hf":
            if spec.regenerate is not None:
                fail("--regenerate generates on the SGLang capture server: run it with --engine sglang")
            factory = hf_engine_factory(settings)
        else:
            dumps = settings.dump_root or out.parent / f".{out.name}-dumps"
            factory = sglang_engine_factory(spec, settings, job=out.name, dump_root=dumps,
                                            log_path=dumps.parent / "sglang-server.log", observe=stages.observe,
                                            on_writer=stages.writer)  # fmt: skip
        run = Run.create(spec, out, factory, settings, _stream_sink(settings, out, dumps))
    stream = run.target.view() is not None
    progress = RichProgress(console, stream=run.target.view if stream else None)
    try:
        with failing_on_errors():
            report = run.rows(events=ProgressEvents(progress))
            report.stage_seconds.update(stages.seconds)
            report = run.finish(report, started=started)
    finally:
        progress.stop()
        run.close()
    console.print(
        f"[green]done[/]: {len(report.computed)} samples computed, {report.already_done} already done"
        f" ({len(report.redone)} redone after failing checks, {len(report.changed)} recomputed because their rows"
        f" changed), {report.tokens:,} tokens in {report.seconds:.1f}s;"
        f" {report.row_errors} bad rows, {report.skipped_overlong} skipped as too long, {report.truncated} truncated,"
        f" {report.failed} failed captures. Output: {out}"
    )
    if (view := run.target.view()) is not None:
        dead = run.target.undelivered()
        settled = f"{dead} dead-lettered by a consumer, the rest acked" if dead else "every one acked"
        console.print(f"streamed: {view.put} samples put to stream {view.name}, {settled}"
                      + (" (no sample files written: --stream-only)" if settings.stream_only else ""))  # fmt: skip
    if spec.regenerate is not None:
        console.print(
            f"regenerated: {report.generated_tokens:,} tokens generated in {report.generation_seconds:.1f}s"
            f" ({report.generated_tokens / max(report.generation_seconds, 1e-9):,.0f} tok/s), {report.turns_cut} turns cut at"
            f" --max-new-tokens, {report.retokenization_mismatches} turns whose text re-tokenizes to other ids"
        )
    ok, verdict = report.verdict(spec.max_bad_rows)
    if not ok:
        fail(verdict, Exit.FAILED)
    if verdict:
        console.print(f"[yellow]warning:[/] {escape(verdict)}")
    click.echo((out / GUIDE).read_text())


def _stream_sink(settings: RunSettings, out: Path, dumps: Path | None) -> MooncakeSink | None:
    """The run's Mooncake sink (`layertap.stream`), connected before its server starts: a master or Redis it cannot
    reach is refused first; its segment a file in the server's dump root ``dumps``, which the server writes samples
    into. None when the run does not stream."""
    if settings.stream is None:
        return None
    from layertap.stream.sink import open_sink

    return open_sink(settings, out, segment_dir=dumps)


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
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="With --data or a regenerated store: run the tokenizer code the model folder ships.",
)
def verify(out: Path, quick: bool, rewrite_token_freq: bool, data: Path | None, trust_remote_code: bool) -> None:
    """Re-read every sample in OUT and report problems (exit 1 if any); print and rewrite OUT/TRAIN.md."""
    from layertap.verify import verify_store

    if data is not None:
        _quiet_libraries()
    with failing_on_errors():
        report = verify_store(out, "quick" if quick else "full", rewrite_token_freq=rewrite_token_freq, data=data,
                              trust_remote_code=trust_remote_code)  # fmt: skip
    _report("verify", report)


@main.command("stream-verify")
@click.argument("name")
@model_options(RunSettings, exclude=tuple(f for f in RunSettings.model_fields if f not in STREAM_ADDRESSES))
@key_prefix_option
@click.option(
    "--group",
    default="stream-verify",
    show_default=True,
    help="The consumer group it reads in: its own gets every sample beside the trainers' group.",
)
@click.option("--consumer", default=None, help="Its name in the group (default: host-pid).")
@click.option("--quick", is_flag=True, help="Skip the finiteness checks.")
@click.option(
    "--idle-timeout",
    type=float,
    default=None,
    help="Give up once nothing arrived for this many seconds: the run not ended, and each sample put and not acked "
    "(its object gone, or pending with another consumer), are then problems. Default: wait, as a trainer does.",
)
def stream_verify(
    name: str, key_prefix: str, group: str, consumer: str | None, quick: bool, idle_timeout: float | None,
    **options: Any,
) -> None:  # fmt: skip
    """Consume stream NAME as a trainer does, checking each sample as verify checks a file (the run's fingerprint:
    model, tokenizer, dataset, layers, dtype, server; keys, shapes, dtypes, input_ids hash, loss mask, finiteness;
    each sample once, each dataset row under one sample id), until its run has ended and every sample is settled.
    Exit 1 on any problem, each named by its sample; the samples dead-lettered (by it or another consumer) are
    problems.

    Each sample is acked once checked, or dead-lettered when its checks fail (an unacked sample holds its producer),
    so it can stand in for a trainer in a smoke run. In a group of its own (the default) it gets every sample beside
    the trainers' group, whose samples stay theirs: an object is removed once every group registered when it was put
    has acked it. A paused stream (its job cancelled) is waited on; with --idle-timeout it is reported."""
    from layertap.stream.verify import verify_stream

    with failing_on_errors():
        settings = RunSettings(**model_values(RunSettings, options))
        report = verify_stream(settings.stream_redis_url, name, master=settings.mooncake_master, group=group,
                               consumer=consumer, prefix=key_prefix, level="quick" if quick else "full",
                               idle_s=idle_timeout)  # fmt: skip
    _report("stream-verify", report)


def _report(command: str, report: VerifyReport) -> NoReturn:
    """Print what ``command`` found (and the training guide it rewrote), then exit 1 on any problem."""
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    for p in report.problems:
        console.print(f"[red]problem:[/] {escape(p)}", soft_wrap=True)
    if report.guide is not None:
        click.echo(report.guide)
    status = "[green]clean[/]" if report.ok else f"[red]{len(report.problems)} problems[/]"
    console.print(
        f"{command} {report.what}: {report.samples} samples, {report.tokens:,} tokens, {report.nbytes:,} bytes: {status}"
    )
    sys.exit(Exit.OK if report.ok else Exit.FAILED)


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
        fail(str(exc))
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

    with failing_on_errors():
        clean = run_demo(out, fmt, console)
    sys.exit(Exit.OK if clean else Exit.FAILED)


@main.command("text-view")
@click.argument("model", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("out", type=click.Path(path_type=Path))
def text_view(model: Path, out: Path) -> None:
    """Make OUT a text-only view of wrapper folder MODEL (Kimi-K2.5) for trainers that cannot take the wrapper:
    config.json is its text_config, the weights are its shards by symlink (nothing copied). TRAIN.md says when."""
    from layertap.models.text_view import write_text_view

    with failing_on_errors():
        console.print(f"text-only view of {model} in {write_text_view(model, out)}")


register_job_commands(main)
register_audit_command(main)
