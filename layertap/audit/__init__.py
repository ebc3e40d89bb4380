"""``layertap audit``: prove that a store holds the model's hidden states, per state and per token, against an
independent HF transformers reference (`compare` judges, `reference` computes, `run` selects and reports)."""

from layertap.audit.run import AuditReport, audit_store

__all__ = ["AuditReport", "audit_store"]
