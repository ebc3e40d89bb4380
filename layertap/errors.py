"""Errors named by who has to act (see STYLE.md §8).

- ``SpecError``: the user's extraction spec or input is wrong; fix it and resubmit (API: 422).
- ``DatasetError``: the dataset as a whole cannot be used (duplicate ids, a chat template that
  yields an all-0/all-1 loss mask); the run stops before writing anything misleading.
- ``RowError``: one dataset row is unusable; it is recorded with its row number and the run goes on.
- ``SampleError``: one capture attempt went wrong (prefix-cache hit, token/hash mismatch, non-finite
  values); retry the sample a bounded number of times.
- ``ServerError``: the inference server is dead or misconfigured; fail the task so work moves elsewhere.
- ``StoreError``: the output store is inconsistent or incompatible with the requested run.
"""


class LayertapError(Exception):
    """Base class of every error this project raises on purpose."""


class SpecError(LayertapError):
    """The extraction spec or a command-line argument is invalid."""


class DatasetError(LayertapError):
    """The dataset cannot be used as a whole."""


class RowError(LayertapError):
    """One dataset row is unusable; carries its row number and sample id."""

    def __init__(self, reason: str, *, row: int, sample_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.row = row
        self.sample_id = sample_id

    def __str__(self) -> str:
        who = f" (id {self.sample_id!r})" if self.sample_id is not None else ""
        return f"row {self.row}{who}: {self.reason}"


class OverlongRow(RowError):
    """A row longer than ``max_length`` under the ``skip`` policy: counted apart from bad rows."""


class SampleError(LayertapError):
    """A capture attempt for one sample failed in a way a retry can fix."""


class ServerError(LayertapError):
    """The inference server is unreachable, dead or misconfigured."""


class StoreError(LayertapError):
    """The output store is inconsistent or belongs to a different run."""
