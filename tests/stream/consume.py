"""A trainer's consumer of a run's stream, in a process of its own: `layertap.stream.StreamConsumer` (hs-connectors'
``MooncakeTransfer`` reads each object), each delivery saved as ``<out>/<sample_id>.safetensors`` before its ack.

One line a delivery on stdout: ``acked SAMPLE_ID XACK EXISTS`` (XACK 1 the first ack of its entry; EXISTS 0 once
its object is removed: by this ack when it completed every group's, else by the last group's). A sample that fails
its checks is dead-lettered by `StreamConsumer.receive`, never saved. With ``--hang-after K`` the K-th delivery is
saved, named in ``<out>/hung`` and held: the process waits until killed (the test's consumer that dies holding a
pending sample) or sent SIGUSR1 (one that acks it late, after its producer died and was resumed meanwhile).
``--group`` names its consumer group (``trainers``).
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from safetensors.torch import save_file

from layertap.stream.consumer import StreamConsumer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("redis_url")
    parser.add_argument("name")
    parser.add_argument("master")
    parser.add_argument("out", type=Path)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--group", default="trainers")
    parser.add_argument("--claim-idle-ms", type=int, default=60_000)
    parser.add_argument("--hang-after", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    consumer = StreamConsumer(args.redis_url, args.name, master=args.master, group=args.group, consumer=args.consumer,
                              claim_idle_ms=args.claim_idle_ms, block_ms=200)  # fmt: skip
    delivered, resume = 0, threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: resume.set())
    while not consumer.finished():
        if (delivery := consumer.receive()) is None:
            continue
        delivered += 1
        tmp = args.out / f".{delivery.sample_id}.tmp"
        save_file({k: t.contiguous() for k, t in delivery.tensors.items()}, tmp)
        tmp.rename(args.out / f"{delivery.sample_id}.safetensors")
        if delivered == args.hang_after:
            (args.out / "hung").write_text(delivery.sample_id)
            resume.wait(3600)
        first = consumer.ack(delivery)
        exists = consumer.transfer.store._store.is_exist(delivery.manifest["handle"])
        print(f"acked {delivery.sample_id} {int(first)} {exists}", flush=True)
    consumer.close()


if __name__ == "__main__":
    main()
