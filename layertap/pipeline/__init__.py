"""One extraction run, as a chain of small steps (read -> identify -> parse -> [regenerate] -> tokenize -> capture
-> commit): the plan (`plan`), the steps (`steps`, `rows`, `generate`, `capture`), where samples go (`targets`), the
ledger (`ledger`) and the run that assembles them (`run`)."""

from layertap.pipeline.ledger import (
    Committed,
    FailureTally,
    ProgressEvents,
    RunReport,
    ShardEvents,
    StageTimes,
    run_verdict,
)
from layertap.pipeline.plan import RunPlan, plan_run
from layertap.pipeline.run import Run, run_extraction, target_for

__all__ = [
    "Committed",
    "FailureTally",
    "ProgressEvents",
    "Run",
    "RunPlan",
    "RunReport",
    "ShardEvents",
    "StageTimes",
    "plan_run",
    "run_extraction",
    "run_verdict",
    "target_for",
]
