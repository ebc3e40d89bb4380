"""``OutputStore``: where a captured sample is validated, written, and committed.

A sample is *done* only when its file was renamed into place AND its index record was appended
after that. A stream-only run's store (manifest ``target`` stream) holds no sample files: its index records are the
samples consumers acked (`log_acked`), each first logged in ``streamed/`` as it was put (`log_streamed`). A regenerated sample's row (its text) is appended to ``regenerated/<writer>.jsonl`` before the index
record, so a row without one never counts; `finalize` gathers the committed samples' rows in
``regenerated.jsonl``. Resume trusts neither alone: it re-checks each indexed file (size, sha256, keys, shapes,
dtypes, token ids) before skipping it, so a truncated or corrupted file is redone. A sample its row no
longer gives is *retired* (`OutputStore.retire`): a line in ``retired/``, then its file removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from layertap.engines.server_facts import ServerFacts
from layertap.errors import SampleError, StoreError
from layertap.models.folder import ModelFolder
from layertap.sample import CapturedSample, TokenizedSample
from layertap.store.atomic import TMP_MARK, atomic_write, atomic_write_json, move_into_place, sha256_file
from layertap.store.formats import SampleFormat, get_format
from layertap.store.formats.base import CheckLevel, torch_dtype
from layertap.store.guide import write_training_guide
from layertap.store.index import (
    ERRORS_DIR,
    INDEX_DIR,
    REGENERATED_DIR,
    RETIRED_DIR,
    STREAMED_DIR,
    JsonlLog,
    SampleRecord,
    load_index_candidates,
    read_jsonl_dir,
)
from layertap.store.manifest import MANIFEST, Manifest, check_compatible, read_manifest
from layertap.store.token_freq import TOKEN_FREQ_DIR, committed_counts, count_line, write_token_freq
from layertap.store.validate import state_problems
from sglang_patch.sample_files import ids_sha256, mask_runs

REGENERATED = "regenerated.jsonl"  # the regenerated dataset: one {"id", "messages"} row per committed sample
SERVERS_DIR = "servers"  # which server each writer's samples come from: <writer>.json, before its first sample


class OutputStore:
    """One output folder. Safe for several processes at once: each appends to its own index log."""

    def __init__(self, root: Path, manifest: Manifest, *, writer_id: str | None = None) -> None:
        self.root = root
        self.manifest = manifest
        self.format: SampleFormat = get_format(manifest.format)
        self.layout = manifest.sample_layout()
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._logs: dict[str, JsonlLog] = {}  # folder -> this writer's log in it
        self._log_lock = threading.Lock()

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def create_or_resume(cls, root: Path, manifest: Manifest, **kw: str) -> OutputStore:
        """Open ``root`` for ``manifest``'s run: create it, or check it belongs to the same run."""
        root.mkdir(parents=True, exist_ok=True)
        if (root / MANIFEST).exists():
            existing = read_manifest(root)
            check_compatible(existing, manifest)
            manifest = manifest.model_copy(update={"complete": False})
        elif any(p.name != ".lock" for p in root.iterdir()):
            raise StoreError(f"{root} is not empty and has no {MANIFEST}; refusing to write into it")
        atomic_write_json(root / MANIFEST, manifest.model_dump())
        return cls(root, manifest, **kw)

    @classmethod
    def open_existing(cls, root: Path) -> OutputStore:
        """Open a store for reading (verify, finalize)."""
        return cls(root, read_manifest(root))

    # -- writing ---------------------------------------------------------------------------------

    def commit(self, captured: CapturedSample) -> SampleRecord:
        """Check the capture once (`record_for`), write it atomically (hashed as written) or move a file already
        in this format into place (hashed from the bytes the engine read it as), then append the index record (the
        record is written last)."""
        record = self.record_for(captured)
        dest = self.root / record.file
        ready = captured.source
        if ready is not None and ready.format == self.format.name and captured.aux.dtype == torch_dtype(self.layout):
            # Already what this store would write: renamed, hashed from the bytes the engine checked (the plugin does
            # not hash: its writers share SGLang's GIL).
            written = move_into_place(ready.path, dest, ready.data)
        else:
            written = atomic_write(dest, lambda f: self.format.write(captured, self.layout, f))
        record = dataclasses.replace(record, nbytes=written.nbytes, sha256=written.sha256)
        self._log_sample(captured.sample, record, INDEX_DIR)
        return record

    def record_for(self, captured: CapturedSample) -> SampleRecord:
        """The record of ``captured`` as this store would commit it, its file not written yet (no size, no hash);
        SampleError when the capture's states are not what the store holds (`state_problems`)."""
        problems = state_problems(captured, self.layout)
        if problems:
            raise SampleError(f"sample {captured.sample.sample_id!r}: " + "; ".join(problems))
        sample = captured.sample
        return SampleRecord(
            sample_id=sample.sample_id,
            index=sample.index,
            num_tokens=sample.num_tokens,
            file=self.format.relpath(sample.index),
            nbytes=0,
            sha256="",
            ids_sha256=ids_sha256(sample.input_ids),
            mask_runs=mask_runs(sample.loss_mask),
            truncated=sample.truncated,
        )

    def log_streamed(self, sample: TokenizedSample, record: SampleRecord) -> None:
        """A stream-only run's sample about to be put (``record.file``: its handle): its token counts and regenerated
        row logged as a commit's are, and its record in ``streamed/``; it counts done once acked (`log_acked`)."""
        self._log_sample(sample, record, STREAMED_DIR)

    def log_acked(self, record: SampleRecord) -> None:
        """A stream-only run's sample a consumer acked: its record in the index, so the store counts it done even
        when the stream's Redis is gone. Not fsynced one by one (the put thread writes it): a line a crash loses is
        written again from Redis's ack and the ``streamed/`` record on resume (`StreamTarget.done`)."""
        self._log(INDEX_DIR).append(record.to_json(), sync=False)

    def streamed(self) -> dict[str, SampleRecord]:
        """sample_id -> the record of its latest put (`log_streamed`), acked or not."""
        return {d["sample_id"]: SampleRecord.from_dict(d) for d in read_jsonl_dir(self.root / STREAMED_DIR)}

    def _log_sample(self, sample: TokenizedSample, record: SampleRecord, folder: str) -> None:
        """Log what a trainer's files are derived from (the token counts, a regenerated row), then the record in
        ``folder``: the record last, so one without the others never counts."""
        self._log(TOKEN_FREQ_DIR).append(count_line(sample, record.ids_sha256))  # counted as committed
        if sample.regenerated is not None:
            line = {"sample_id": sample.sample_id, "ids_sha256": record.ids_sha256, "row": sample.regenerated,
                    "generated_tokens": sample.generated_tokens}  # fmt: skip
            self._log(REGENERATED_DIR).append(json.dumps(line, ensure_ascii=False))
        self._log(folder).append(record.to_json())

    def retire(self, record: SampleRecord) -> None:
        """Take a committed sample out of the store (its row no longer gives it): the retirement is logged, then
        the file removed, which is what makes it count (`records`); a commit of the row since brings it back."""
        self._log(RETIRED_DIR).append(json.dumps({"sample_id": record.sample_id, "sha256": record.sha256}))
        (self.root / record.file).unlink(missing_ok=True)

    def note_server(self, facts: ServerFacts, rows: tuple[int, int]) -> list[str]:
        """Record that this writer's samples of rows ``[start, stop)`` come from the server of ``facts`` (the engine's
        `provenance`), unless another server of this store computed differently: then nothing is recorded and the
        differences come back, naming both sides (empty: recorded)."""
        folder = self.root / SERVERS_DIR
        mine = facts.computes()
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            other = json.loads(path.read_text())
            if path.stem != self.writer_id and (theirs := other["engine"]["computes"]) != mine:
                return [
                    f"{k} is {mine.get(k)!r} here, {theirs.get(k)!r} on the server at {other['engine']['url']} that "
                    f"made rows {other['rows']} of this store ({other['writer']})"
                    for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)
                ]  # fmt: skip
        engine = {"url": facts.url, "server": facts.record(), "computes": mine}
        entry = {"writer": self.writer_id, "rows": list(rows), "engine": engine, "time": time.time()}
        atomic_write_json(folder / f"{self.writer_id}.json", entry)
        return []

    def servers(self) -> list[dict[str, Any]]:
        """Every writer's server record (`note_server`), oldest first."""
        folder = self.root / SERVERS_DIR
        entries = [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.is_dir() else []
        return sorted(entries, key=lambda e: e["time"])

    def record_error(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None:
        """Keep a per-row failure (bad row, skipped over-long sample, failed capture) for the report."""
        entry = {"row": row, "sample_id": sample_id, "reason": reason, "kind": kind, "time": time.time()}
        self._log(ERRORS_DIR).append(json.dumps(entry))

    def _log(self, folder: str) -> JsonlLog:
        with self._log_lock:  # commits run in several threads; open each log once
            if folder not in self._logs:
                self._logs[folder] = JsonlLog(self.root / folder / f"{self.writer_id}.jsonl")
            return self._logs[folder]

    def close(self) -> None:
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    # -- reading ---------------------------------------------------------------------------------

    def records(self) -> dict[str, SampleRecord]:
        """sample_id -> the record describing its file.

        That is the latest record, except when two writers committed the same sample with different
        bytes (a frozen worker whose lease was taken over): both renamed a file to the same path, in
        an order the logs cannot tell, so the record whose sha256 matches the file on disk wins. A retired
        record (`retire`) is left out while its file is not on disk as it recorded.
        """
        retired = {(d["sample_id"], d["sha256"]) for d in read_jsonl_dir(self.root / RETIRED_DIR)}
        out = {}
        for sample_id, candidates in load_index_candidates(self.root).items():
            latest = candidates[-1]
            if len({r.sha256 for r in candidates}) > 1:
                on_disk = self._file_sha256(latest.file)
                latest = next((r for r in reversed(candidates) if r.sha256 == on_disk), latest)
            if (sample_id, latest.sha256) in retired and self._file_sha256(latest.file) != latest.sha256:
                continue
            out[sample_id] = latest
        return out

    def regenerated_rows(self, records: dict[str, SampleRecord]) -> dict[str, dict[str, Any]]:
        """sample_id -> the regenerated row committed with the sample of ``records``; samples with none are left
        out."""
        return {sample_id: line["row"] for sample_id, line in self.regenerated_lines(records).items()}

    def regenerated_lines(self, records: dict[str, SampleRecord]) -> dict[str, dict[str, Any]]:
        """sample_id -> the ``regenerated/`` line logged with the sample of ``records`` (with its ids): its ``row``
        and ``generated_tokens`` (absent from a store written before they were logged)."""
        lines = {}
        for line in read_jsonl_dir(self.root / REGENERATED_DIR):
            rec = records.get(line["sample_id"])
            if rec is not None and rec.ids_sha256 == line["ids_sha256"]:
                lines[rec.sample_id] = line
        return lines

    def _file_sha256(self, rel: str) -> str | None:
        try:
            return sha256_file(self.root / rel)
        except FileNotFoundError:
            return None

    def errors(self) -> list[dict]:
        """Latest error per row, dropping rows that were committed since."""
        done = {r.index for r in self.records().values()}
        latest = {e["row"]: e for e in read_jsonl_dir(self.root / ERRORS_DIR)}
        return [e for row, e in sorted(latest.items()) if row not in done]

    def check(self, record: SampleRecord, level: CheckLevel = "full") -> list[str]:
        """Problems of one committed sample's file; empty means it can be trusted."""
        path = self.root / record.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return ["file missing"]
        if size != record.nbytes:
            return [f"size {size} != recorded {record.nbytes} (truncated or overwritten)"]
        if level == "full" and sha256_file(path) != record.sha256:
            return ["sha256 differs from the index record (corrupted)"]
        return self._content_problems(path, record, level)

    def _content_problems(self, path: Path, record: SampleRecord, level: CheckLevel) -> list[str]:
        """What the trainer would read from ``path`` against ``record``; ``full`` also checks finiteness."""
        try:
            tensors = self.format.load(path)
        except Exception as exc:
            return [f"unreadable: {exc}"]
        return self.format.content_problems(tensors, record, self.layout, level)

    def sweep_temp_files(self) -> int:
        """Delete temp files of killed writers. Only call when no other writer uses the store."""
        count = 0
        for path in self.root.rglob(f"{TMP_MARK}*"):
            if path.is_file():
                path.unlink()
                count += 1
        return count

    # -- finishing -------------------------------------------------------------------------------

    def finalize(self, *, complete: bool, target: ModelFolder | None) -> list[SampleRecord]:
        """Build the format's extra files from the index and rewrite the manifest with the count; the training
        guide from ``target``, the model folder as the run read it (`guide.target_folder` where none did)."""
        by_id = self.records()
        records = sorted(by_id.values(), key=lambda r: r.index)
        if self.manifest.target != "stream":  # a stream-only store's samples went to its consumers
            self.format.finalize(self.root, records)
        if self.manifest.generation is not None:
            rows = self.regenerated_rows(by_id)
            lines = (json.dumps(rows[r.sample_id], ensure_ascii=False) + "\n" for r in records if r.sample_id in rows)
            atomic_write(self.root / REGENERATED, lambda f: f.write("".join(lines).encode()))
        write_token_freq(self.root, committed_counts(self.root, records, self.layout.ids_key))
        servers = self.servers()
        update = {"complete": complete, "samples_committed": len(records), "servers": servers}
        if self.manifest.input_limit is None and (limit := servers_input_limit(servers)) is not None:
            update["input_limit"] = limit  # a job without max_length: its workers' servers' limit
        self.manifest = self.manifest.model_copy(update=update)
        atomic_write_json(self.root / MANIFEST, self.manifest.model_dump())
        write_training_guide(self.root, self.manifest, records, target)
        return records


_OLD_SERVER_LIMIT = "max_input_tokens"  # a server's input limit in writer records made before it was renamed


def servers_input_limit(servers: list[dict[str, Any]]) -> int | None:
    """The length rows were kept within by the servers of ``servers`` (`OutputStore.servers`): the largest of their
    input limits (each kept its rows within its own; a sample its server truncated says so in its record), None
    when none is recorded or one server stated no limit."""
    facts = [entry["engine"]["server"] for entry in servers]
    limits = [server.get("input_limit", server.get(_OLD_SERVER_LIMIT)) for server in facts]
    return None if not limits or None in limits else max(limits)
