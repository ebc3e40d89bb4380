"""Committed samples streamed to trainers through Mooncake Store, with no disk between them (#46).

Each sample is one packed object in the layout of vLLM speculators' hs-connectors (its Mooncake backend:
`hs_connectors.mooncake_store`), its manifest an entry of a Redis stream that trainers read through a consumer group:

- ``mooncake.py``: the Mooncake Store client (a master refused in one line, puts hard-pinned), the manifest
  (hs-connectors' ``packed_layout``) with layertap's identity in its metadata;
- ``segment.py``: the producer's segment, its pages faulted in by threads of their own before the puts need them;
- ``sink.py``: the producer, `MooncakeSink`: a committed sample put and XADDed, held at a bound of unacked samples,
  its segment kept alive until every sample it put is acked;
- ``consumer.py``: `StreamConsumer` (XREADGROUP, XAUTOCLAIM of a dead consumer's pending entries, hs-connectors'
  own reader, identity checks, each group's ack, the object removed once every group acked it, dead letters, a
  paused job's stream) and `StreamDataset`, a torch ``IterableDataset`` over it;
- ``trainers.py``: a streamed sample in the shapes speculators' and SpecForge's own data pipelines take;
- ``verify.py``: ``layertap stream-verify``, a consumer that checks each sample as ``verify`` checks a file.
"""
