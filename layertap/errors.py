"""Errors named by who has to act (the caller, the data or the operator).

- ``SpecError``: the user's extraction spec or input is wrong; fix it and resubmit (API: 422).
- ``DatasetError``: the dataset as a whole cannot be used (unreadable, no rows, a chat template that
  masks a plain chat all 0 or all 1); the run stops before writing anything misleading.
- ``RowError``: one dataset row is unusable; it is recorded with its row number, id, kind (``ROW_KINDS``)
  and reason, and the run goes on.
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


# Why a row produced no sample, as the store's errors/ and the API report it.
ROW_KINDS: dict[str, str] = {
    "row": "unreadable, or not a usable row shape (types, missing fields, unknown roles)",
    "encoding": "text that cannot be encoded as UTF-8 (lone surrogates)",
    "duplicate_id": "an id an earlier row already has (the first is kept)",
    "template": "the chat template failed or is not prefix-stable on this row",
    "tokenizer": "the tokenizer failed or gave no tokens",
    "loss_mask": "the loss mask came out all 0 or all 1",
    "overlong": "longer than max_length under the skip policy",
    "input_limit": "longer than the run's input limit, its SGLang server's prompt limit (a job's max_length above it, "
    "not known at submit)",
    "regenerate": "nothing to regenerate (preformatted text, token ids, no user turn before an assistant turn)",
    "generation": "the server refused to generate this row's responses (e.g. a prompt past its context length), or "
    "aborted their generation every attempt",
    "generation_truncated": "a regenerated turn was cut at max_new_tokens under drop_truncated",
    "capture": "the capture failed every attempt",
    "internal": "an unexpected error while preparing the row (a bug: please report it)",
}


class RowError(LayertapError):
    """One dataset row is unusable; carries its row number, sample id and kind (a key of ``ROW_KINDS``)."""

    kind = "row"

    def __init__(self, reason: str, *, row: int, sample_id: str | None = None, kind: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.row = row
        self.sample_id = sample_id
        if kind is not None:
            self.kind = kind

    def __str__(self) -> str:
        who = f" (id {self.sample_id!r})" if self.sample_id is not None else ""
        return f"row {self.row}{who}: {self.reason}"

    def __reduce__(self) -> tuple:
        """Pickled with its keywords (a row planned in another process: `layertap.pipeline.lookahead`)."""
        return _row_error, (type(self), self.reason, self.row, self.sample_id, self.kind)


def _row_error(cls: type[RowError], reason: str, row: int, sample_id: str | None, kind: str) -> RowError:
    return cls(reason, row=row, sample_id=sample_id, kind=kind)


class OverlongRow(RowError):
    """A row longer than ``max_length`` under the ``skip`` policy: counted apart from bad rows."""

    kind = "overlong"


class SampleError(LayertapError):
    """A capture attempt for one sample failed in a way a retry can fix."""


class ServerError(LayertapError):
    """The inference server is unreachable, dead or misconfigured."""


class ServerConfigError(ServerError):
    """The server's command line is refused (a flag SGLang or the launcher rejects): whatever the model, a start with
    the same settings ends the same way."""


class StoreError(LayertapError):
    """The output store is inconsistent or belongs to a different run."""
