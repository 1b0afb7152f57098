"""Where D maps a P's staging and which GPU holds it (kvcached_pd.transport.cuda_ipc).

The GPU itself is faked (device count, UUIDs, peer access): what is tested is the
choice, which a CPU can run. Across two GPUs D opens P's handle in its own GPU's
context (peer access), so the mapped tensor names D's GPU while the memory is on P's;
2 x H100, 2026-11-26: D's unmap line read the tensor's GPU and said "rose by 0 MiB"
for a killed P whose staging was on the other one.
"""

from __future__ import annotations

import pytest
import torch

from kvcached_pd.transport import cuda_ipc


@pytest.fixture
def two_gpus(monkeypatch):
    uuids = ["GPU-d", "GPU-p"]
    peers = {(0, 1): True, (1, 0): True}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: uuids[device.index])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer",
                        lambda a, b: peers.get((a, b), False))
    return uuids, peers


def export_on(uuid: str) -> cuda_ipc.StagingExport:
    return cuda_ipc.StagingExport(host=cuda_ipc.host_identity(), device_uuid=uuid,
                                  nbytes=1 << 20, memory=(), events=())


def test_across_two_gpus_d_maps_on_its_own_gpu_and_names_ps_as_the_holder(two_gpus):
    own, home, how = cuda_ipc.local_device_of(export_on("GPU-p"), torch.device("cuda", 0))
    assert (own, home) == (0, 1) and how == "peer access from GPU 0 to GPU 1"
    assert cuda_ipc.local_device_of(export_on("GPU-d"), torch.device("cuda", 0)) == (
        0, 0, "same GPU")


def test_a_peer_gpu_d_cannot_reach_or_see_is_refused_with_the_reason(two_gpus):
    uuids, peers = two_gpus
    peers[(0, 1)] = False
    with pytest.raises(cuda_ipc.IpcUnavailable, match="cannot access the peer's GPU"):
        cuda_ipc.local_device_of(export_on("GPU-p"), torch.device("cuda", 0))
    with pytest.raises(cuda_ipc.IpcUnavailable, match="not visible"):
        cuda_ipc.local_device_of(export_on("GPU-elsewhere"), torch.device("cuda", 0))


def test_a_mapping_cannot_be_made_without_naming_the_gpu_that_holds_it():
    # the tensor's own device is D's across two GPUs: no default may stand in for P's
    with pytest.raises(TypeError):
        cuda_ipc.MappedStaging(torch.empty(4, dtype=torch.uint8), [])
