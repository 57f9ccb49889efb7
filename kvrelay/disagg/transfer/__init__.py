"""KV transfer backends, chosen with --transfer-backend and imported only when chosen.

Every backend is a `transfer.common.CommonManager` subclass implementing the data path
(`transfer.base.DataPath`); the contract is in `transfer.base`. A new backend is one module
and one `register_lazy` line here: the CLI's choices and every test matrix read this registry.
"""
from __future__ import annotations

from kvrelay.core.registry import Registry

TRANSFER_BACKENDS: Registry = Registry("transfer backend")
TRANSFER_BACKENDS.register_lazy("fake", "kvrelay.disagg.transfer.fake:FakeManager")
TRANSFER_BACKENDS.register_lazy("fake-twosided", "kvrelay.disagg.transfer.fake:FakeTwoSidedManager")
TRANSFER_BACKENDS.register_lazy("shm", "kvrelay.disagg.transfer.shm:ShmManager")
TRANSFER_BACKENDS.register_lazy("tcp", "kvrelay.disagg.transfer.tcp:TcpManager")
TRANSFER_BACKENDS.register_lazy("nixl", "kvrelay.disagg.transfer.nixl:NixlManager")
TRANSFER_BACKENDS.register_lazy("cuda_ipc", "kvrelay.disagg.transfer.cuda_ipc:CudaIpcManager")


def create_manager(name: str, layout, transfer=None, **kwargs):
    """Build the manager registered as `name`. kwargs: lifecycle, clock, channel, worker_id, auth
    (see CommonManager); the fake backends also need `channel` or `network`."""
    return TRANSFER_BACKENDS.get(name)(layout, transfer, **kwargs)
