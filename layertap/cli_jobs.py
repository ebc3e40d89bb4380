"""Commands for distributed runs: ``coordinator``, ``submit``, ``status``, ``cancel``, ``resume``, ``rebuild-state``.

All but ``coordinator`` and ``rebuild-state`` are thin wrappers over the coordinator's HTTP API
(``--api``/``LAYERTAP_API_URL``, bearer ``--token``/``LAYERTAP_API_TOKEN``). ``rebuild-state`` talks
to Redis directly: it is what you run when Redis lost the job, whether or not a coordinator is up.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

from layertap.cli_base import (
    AUDIT_EXIT,
    Exit,
    console,
    fail,
    failing_on_errors,
    key_prefix_option,
    model_options,
    model_values,
)
from layertap.logs import configure_logging, level_for
from layertap.state.model import JobRequest
from layertap.trainers import GUIDE

TERMINAL = {"done", "failed", "cancelled"}
AUDIT_OPEN = {"pending", "running"}  # an ended job's audit still to come

api_option = click.option(
    "--api", envvar="LAYERTAP_API_URL", default="http://127.0.0.1:8000", show_default=True, help="Coordinator URL."
)
token_option = click.option("--token", envvar="LAYERTAP_API_TOKEN", default=None, help="Bearer token, if required.")


def _call(api: str, token: str | None, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
    """One API call; HTTP errors become a readable message and exit code 2."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.request(method, api.rstrip("/") + path, json=body, headers=headers, timeout=600)
    except httpx.HTTPError as exc:
        fail(f"cannot reach the coordinator at {api}: {exc}")
    if reply.status_code >= 400:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        if isinstance(detail, list):  # pydantic's validation errors: one line each
            detail = "; ".join(f"{'.'.join(str(p) for p in d['loc'][1:])}: {d['msg']}" for d in detail)
        fail(f"{reply.status_code}: {detail}")
    return reply.json()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _show(job: dict[str, Any]) -> None:
    table = Table(title=f"job {job['job_id']}", show_header=False)
    table.add_row("state", job["state"] + (f" ({job['error']})" if job.get("error") else ""))
    table.add_row(
        "samples", f"{job['samples_done']:,} done, {job['samples_failed']:,} failed of {job['samples_total']:,}"
    )
    estimate = job["tokens_total_estimate"]
    table.add_row("tokens", f"{job['tokens_done']:,} done" + (f" of ~{estimate:,}" if estimate else ""))
    table.add_row("rate", f"{job['samples_per_s']:.1f} samples/s, {job['tokens_per_s']:,.0f} tokens/s")
    if gen := job.get("generation"):
        table.add_row("generation", _generation(gen))
    table.add_row("ETA", _duration(job["eta_s"]))
    table.add_row("shards", ", ".join(f"{n} {state}" for state, n in sorted(job["shards"].items())))
    table.add_row("output", job["out"])
    if audit := job.get("audit"):
        detail = f": {audit['summary']}" if audit["summary"] else f" ({audit['samples']} samples)"
        table.add_row(
            "audit", _audit_state(audit) + detail + (f"; report {audit['report']}" if audit["report"] else "")
        )
    for w in job["workers"]:
        live = f"shard {w['shard']}, {w['samples_per_s']:.1f} samples/s" if w["alive"] else "not working on it now"
        table.add_row(f"worker {w['name']}", f"{w['samples']:,} samples, {w['tokens']:,} tokens; {live}")
    Console().print(table)


def _generation(gen: dict[str, Any]) -> str:
    """A regenerating job's generation: rows and new tokens so far, turns cut at max_new_tokens, rate and time left."""
    return (
        f"{gen['rows']:,} rows regenerated, {gen['tokens']:,} new tokens, {gen['cut_turns']:,} turns cut at "
        f"max_new_tokens; {gen['tokens_per_s']:,.0f} tokens/s, done in {_duration(gen['eta_s'])}"
    )


def _audit_state(audit: dict[str, Any]) -> str:
    """The audit's state or verdict, where it runs and how far its reference is (layers run over every sample)."""
    line = audit["state"].upper() if audit["state"] in ("pass", "fail", "inconclusive") else audit["state"]
    if audit["device"]:
        line += f" on {audit['device']}"
    return line + (f", {audit['layers_done']}/{audit['layers_total']} layers" if audit["layers_total"] else "")


def _follow(api: str, token: str | None, job_id: str, every: float) -> dict[str, Any]:
    """Poll until the job reaches a terminal state and its audit (if it asked for one) has its verdict; one line
    of progress per poll on stderr."""
    while True:
        job = _call(api, token, "GET", f"/jobs/{job_id}")
        audit = job.get("audit")
        console.print(
            f"{job['state']}: {job['samples_done']:,}/{job['samples_total']:,} samples, "
            f"{job['samples_failed']:,} failed, {job['tokens_per_s']:,.0f} tok/s"
            + (f", {gen['tokens_per_s']:,.0f} generated tok/s" if (gen := job.get("generation")) else "")
            + f", ETA {_duration(job['eta_s'])}"
            + (f"; audit {_audit_state(audit)}" if audit else "")
        )
        if _settled(job):
            return job
        time.sleep(every)


def _settled(job: dict[str, Any]) -> bool:
    """The job has ended, and so has its audit if it asked for one (a cancelled job's audit never runs)."""
    audit = job.get("audit")
    return job["state"] in TERMINAL and (job["state"] == "cancelled" or not audit or audit["state"] not in AUDIT_OPEN)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.pass_obj
def coordinator(verbose: int, host: str, port: int) -> None:
    """Run the coordinator API (settings from LAYERTAP_* variables; same as `uvicorn coordinator.app:app`). It needs
    LAYERTAP_API_TOKEN, or LAYERTAP_API_OPEN=true to serve anyone who can reach it."""
    import uvicorn

    configure_logging(level_for(verbose, default=logging.INFO))
    uvicorn.run("coordinator.app:app", host=host, port=port, log_config=None)  # uvicorn's lines in our format too


@click.command()
@model_options(JobRequest)
@click.option(
    "--wait",
    is_flag=True,
    help="Follow the job until it ends (and its audit); exit 1 unless done, then as `audit` on its verdict.",
)
@api_option
@token_option
def submit(wait: bool, api: str, token: str | None, **options: Any) -> None:
    """Submit a job to the coordinator; prints its id on stdout. Paths must be readable by every worker."""
    options["model"], options["data"] = options["model"].resolve(), options["data"].resolve()
    with failing_on_errors():
        body = JobRequest(**model_values(JobRequest, options)).model_dump(mode="json")
    job = _call(api, token, "POST", "/jobs", body)
    console.print(
        f"job {job['job_id']}: {job['samples_total']:,} samples in {job['num_shards']} shards -> {job['out']}"
    )
    click.echo(job["job_id"])
    if wait:
        job = _follow(api, token, job["job_id"], every=2.0)
        _show(job)
        if job["state"] == "done" and (guide := Path(job["out"]) / GUIDE).exists():  # where this host sees it
            click.echo(guide.read_text())
        sys.exit(wait_exit(job))


def wait_exit(job: dict[str, Any]) -> Exit:
    """`submit --wait`'s status for the job it followed: a done job's is its audit verdict's, as `layertap audit`
    exits on it (0 when it asked for none); 1 for a job not done or an audit that could not run."""
    if job["state"] != "done":
        return Exit.FAILED
    audit = job.get("audit")
    return Exit.OK if audit is None else AUDIT_EXIT.get(audit["state"], Exit.FAILED)


@click.command()
@click.argument("job_id", required=False)
@click.option("--watch", is_flag=True, help="Follow the job until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@api_option
@token_option
def status(job_id: str | None, watch: bool, as_json: bool, api: str, token: str | None) -> None:
    """Show a job's progress (or list jobs when JOB_ID is left out)."""
    if job_id is None:
        jobs = _call(api, token, "GET", "/jobs")["jobs"]
        if as_json:
            click.echo(json.dumps(jobs, indent=1))
            return
        table = Table("job", "state", "samples done", "failed", "total", "output")
        for j in jobs:
            table.add_row(j["job_id"], j["state"], f"{j['samples_done']:,}", f"{j['samples_failed']:,}",
                          f"{j['samples_total']:,}", j["out"])  # fmt: skip
        Console().print(table)
        return
    job = _follow(api, token, job_id, every=2.0) if watch else _call(api, token, "GET", f"/jobs/{job_id}")
    if as_json:
        click.echo(json.dumps(job, indent=1))
    else:
        _show(job)


@click.command()
@click.argument("job_id")
@api_option
@token_option
def cancel(job_id: str, api: str, token: str | None) -> None:
    """Stop dispatching a job; running shards stop at their next sample."""
    click.echo(_call(api, token, "POST", f"/jobs/{job_id}/cancel")["state"])


@click.command()
@click.argument("job_id")
@api_option
@token_option
def resume(job_id: str, api: str, token: str | None) -> None:
    """Dispatch every unfinished shard of a job again (committed samples are kept)."""
    click.echo(_call(api, token, "POST", f"/jobs/{job_id}/resume")["state"])


@click.command("rebuild-state")
@click.argument("out", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--redis-url", envvar="LAYERTAP_REDIS_URL", required=True, help="The Redis the coordinator uses.")
@key_prefix_option
@click.option("--replace", is_flag=True, help="Overwrite the job if Redis still holds it.")
@click.option("--full", is_flag=True, help="Re-hash every committed file instead of checking size, shapes and ids.")
def rebuild_state(out: Path, redis_url: str, key_prefix: str, replace: bool, full: bool) -> None:
    """Recreate the Redis state of the job that wrote OUT from its index; the coordinator then resumes it."""
    from redis import Redis

    from layertap.state.keys import Keys
    from layertap.state.rebuild import rebuild_job

    redis = Redis.from_url(redis_url, decode_responses=True)
    with failing_on_errors():
        rebuilt = rebuild_job(
            redis, Keys(key_prefix), out.resolve(), check_level="full" if full else "quick", replace=replace
        )
    console.print(
        f"job {rebuilt.job_id}: {rebuilt.state}; {rebuilt.shards_done}/{rebuilt.num_shards} shards done, "
        f"{rebuilt.samples_done:,} samples committed, {rebuilt.samples_failed:,} failed. "
        + ("The coordinator dispatches the rest." if rebuilt.state != "done" else "")
    )
    click.echo(rebuilt.job_id)


def register_job_commands(group: click.Group) -> None:
    """Add the distributed-run commands to the ``layertap`` group."""
    for command in (coordinator, submit, status, cancel, resume, rebuild_state):
        group.add_command(command)
