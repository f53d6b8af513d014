"""gRPC's own count of the calls of this server's ports (Channelz, read in-process).

laneserve's counters start where its servicer does; calls that end before it appear
only here. Those gRPC's core refused (`max_pending_calls`) count as started and never
end; those whose caller cancelled, or whose deadline passed, before the event loop took
them count as failed, as does every call that ends with a status other than OK.
"""

from __future__ import annotations

import dataclasses
import typing

import grpc
from grpc_channelz.v1 import channelz_pb2
from grpc_channelz.v1.channelz import ChannelzServicer


@dataclasses.dataclass(frozen=True, slots=True)
class GrpcCalls:
    started: int
    succeeded: int
    failed: int

    @property
    def unended(self) -> int:
        """Calls neither succeeded nor failed: running, held in gRPC's core, or refused
        there (`max_pending_calls`: those never end)."""
        return self.started - self.succeeded - self.failed


class _NoContext:
    """Stands in for the servicer context the static methods report failures to: a
    failed read then returns None (the typing says a response, always)."""

    def set_code(self, code: grpc.StatusCode) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass


def _no_context() -> grpc.ServicerContext:
    return typing.cast(grpc.ServicerContext, _NoContext())


class GrpcCallCounts:
    """Reads the summed call counts of some of this process's gRPC servers, by Channelz id.

    known = GrpcCallCounts.server_ids()
    server = grpc.aio.server(...)  # no await in between: no other server is made meanwhile
    counts = GrpcCallCounts(GrpcCallCounts.server_ids() - known)
    """

    def __init__(self, server_ids: set[int]) -> None:
        self._ids = frozenset(server_ids)

    @staticmethod
    def server_ids() -> set[int]:
        """The Channelz ids of every gRPC server this process has now."""
        ids: set[int] = set()
        start = 0
        while True:
            page: object = ChannelzServicer.GetServers(
                channelz_pb2.GetServersRequest(start_server_id=start), _no_context()
            )
            if not isinstance(page, channelz_pb2.GetServersResponse) or not page.server:
                return ids
            page_ids = [server.ref.server_id for server in page.server]
            ids.update(page_ids)
            if page.end:
                return ids
            start = max(page_ids) + 1

    def read(self) -> GrpcCalls | None:
        """Counts since the servers started; None when gRPC cannot say (channelz off)."""
        if not self._ids:
            return None
        started = succeeded = failed = 0
        for server_id in self._ids:
            response: object = ChannelzServicer.GetServer(
                channelz_pb2.GetServerRequest(server_id=server_id), _no_context()
            )
            if not isinstance(response, channelz_pb2.GetServerResponse):
                return None
            data = response.server.data
            started += data.calls_started
            succeeded += data.calls_succeeded
            failed += data.calls_failed
        return GrpcCalls(started, succeeded, failed)
