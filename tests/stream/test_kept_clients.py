"""A worker's producers keep their Mooncake client from one shard attempt to the next (`KeptClients`, a real
``mooncake_master`` and Redis): a sink that leaves nothing unsettled gives its client back, and the next sink puts
through the same segment, mounted once; a sink that leaves a sample unacked unmounts its segment, the object going
with it as a killed producer's does, and the next sink mounts a new one."""

from __future__ import annotations

import torch

from harness.mooncake import MooncakeMaster
from harness.services import RedisServer
from layertap.settings import RunSettings
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import connect, disconnect, objects_present
from layertap.stream.sink import KeptClients
from tests.monitoring.test_live import scraped

MOUNTS = ("master_mount_segment_requests_total", ())


def test_a_clean_producers_client_is_kept_and_one_that_left_a_sample_unacked_is_unmounted(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, tmp_path
) -> None:
    settings = RunSettings(stream="mooncake", mooncake_master=mooncake_master.address,
                           stream_redis_url=redis_server.url, mooncake_segment_mib=64, stream_name="kept")  # fmt: skip
    tensors = {"hidden_states": torch.randn(50, 2, 64).to(torch.bfloat16), "token_ids": torch.arange(50),
               "loss_mask": torch.ones(50, dtype=torch.uint8)}  # fmt: skip
    reader = connect(mooncake_master.address, segment_bytes=0)  # a consumer's client: it mounts nothing
    clients = KeptClients()
    try:
        first = clients.open(settings, tmp_path)
        clients.give_back(first)  # nothing put: nothing of it in its segment
        second = clients.open(settings, tmp_path)
        assert second.store is first.store and second.nonce != first.nonce  # new handles through the same segment
        assert scraped(mooncake_master.metrics_url)[MOUNTS] == 1

        second.put(second.staged(SampleRecord("s0", 0, 50, "", 0, "", "", ((0, 50),)), tensors), tensors)
        [(handle, _)] = second.unacked.values()
        assert objects_present(reader, [handle]) == [True]
        clients.give_back(second)  # its sample unacked: the segment goes, and the object with it
        assert clients.kept == {} and objects_present(reader, [handle]) == [False]

        third = clients.open(settings, tmp_path)
        assert third.store is not first.store and scraped(mooncake_master.metrics_url)[MOUNTS] == 2
        clients.give_back(third)
        assert len(clients.kept) == 1
    finally:
        clients.close()
        disconnect(reader)
    assert clients.kept == {}
