"""One extraction run, as a chain of small steps (read -> identify -> parse -> [regenerate] -> tokenize -> capture
-> commit): the plan (`plan`), the steps (`steps`, `rows`, `generate`, `capture`), the ledger (`ledger`) and the
chain (`run`)."""

from layertap.pipeline.ledger import FailureTally, ProgressEvents, RunReport, ShardEvents, run_verdict
from layertap.pipeline.plan import RunPlan, plan_run
from layertap.pipeline.run import run_extraction, run_shard

__all__ = [
    "FailureTally",
    "ProgressEvents",
    "RunPlan",
    "RunReport",
    "ShardEvents",
    "plan_run",
    "run_extraction",
    "run_shard",
    "run_verdict",
]
