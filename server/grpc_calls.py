"""gRPC's own count of this server's calls (Channelz, read in-process).

laneserve's counters start where its servicer does; calls gRPC's core refused before
that (`max_pending_calls`) or dropped there (expired before the event loop took them)
appear only here: started, and neither succeeded nor failed.
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
    """Reads one server's call counts. Create it right after that server started: it
    takes the newest server gRPC knows in this process (ids only grow)."""

    def __init__(self) -> None:
        newest = 0
        start = 0
        while True:
            page: object = ChannelzServicer.GetServers(
                channelz_pb2.GetServersRequest(start_server_id=start), _no_context()
            )
            if not isinstance(page, channelz_pb2.GetServersResponse) or not page.server:
                break
            ids = [server.ref.server_id for server in page.server]
            newest = max(newest, *ids)
            if page.end:
                break
            start = max(ids) + 1
        self.server_id = newest

    def read(self) -> GrpcCalls | None:
        """Counts since the server started; None when gRPC cannot say (channelz off)."""
        if self.server_id == 0:
            return None
        response: object = ChannelzServicer.GetServer(
            channelz_pb2.GetServerRequest(server_id=self.server_id), _no_context()
        )
        if not isinstance(response, channelz_pb2.GetServerResponse):
            return None
        data = response.server.data
        return GrpcCalls(data.calls_started, data.calls_succeeded, data.calls_failed)
