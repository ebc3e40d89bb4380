"""``layertap audit``: check a store's hidden states against an HF transformers reference (see `layertap.audit`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from layertap.cli_base import AUDIT_EXIT, console, failing_on_errors
from layertap.device import DEVICE_HELP

COLOUR = {"pass": "green", "fail": "red", "inconclusive": "yellow"}


@click.command()
@click.argument("out", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--samples", type=int, default=None, help="Samples to audit (default 32 unless --fraction).")
@click.option("--fraction", type=float, default=None, help="Share of the committed samples to audit instead.")
@click.option("--seed", type=int, default=0, show_default=True, help="Picks the samples: same seed, same samples.")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help=f"{DEVICE_HELP}. One device holds the whole audit.",
)
@click.option(
    "--model",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="The model folder, if it moved since the extraction (its config.json must be the manifest's).",
)
@click.option("--batch-tokens", type=int, default=16384, show_default=True, help="Padded tokens per attention step.")
@click.option("--no-final", is_flag=True, help="Leave the final state out: run only up to the deepest captured layer.")
@click.option("--trust-remote-code", is_flag=True, help="As for extract: the folder ships code (read it first).")
def audit(
    out: Path,
    samples: int | None,
    fraction: float | None,
    seed: int,
    device: str,
    model: Path | None,
    batch_tokens: int,
    no_final: bool,
    trust_remote_code: bool,
) -> None:
    """Audit a random subset of OUT's samples against the model run in HF transformers.

    Exit status: 0 PASS, 1 FAIL, 2 the audit could not run, 3 INCONCLUSIVE (the comparison cannot tell a wrong state
    from the noise floor there, e.g. the final state of a deep random-weight model in bf16: the report says why
    and what would decide it, such as a float32 store or --no-final).

    The model runs one decoder layer at a time from its shards (routed experts one by one, INT4 ones dequantized on
    the fly), so one GPU, or the CPU, audits any depth: it says what it needs before it starts.

    Per captured state and token: the error against a float32 reference, next to the noise floor (the same
    reference at the store's compute dtype), outliers explained by MoE routing near-ties, and negative controls
    that must fail. Writes OUT/reports/audit-*.json and .md."""
    import transformers

    from layertap.audit import audit_store

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if samples is None and fraction is None:
        samples = 32
    with failing_on_errors():
        report = audit_store(out, samples=samples, fraction=fraction, seed=seed, device=device, model=model,
                             trust_remote_code=trust_remote_code, batch_tokens=batch_tokens, final=not no_final,
                             say=lambda line: console.print(escape(line)))  # fmt: skip
    click.echo(report.markdown())
    console.print(f"[{COLOUR[report.verdict]}]{escape(report.summary())}[/]; report: {', '.join(report.files)}")
    sys.exit(AUDIT_EXIT[report.verdict])


def register_audit_command(group: click.Group) -> None:
    group.add_command(audit)
