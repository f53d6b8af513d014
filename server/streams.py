"""The parts of one stream mechanism for every front end's stream (InferStream, KServe's
ModelStreamInfer; `InferenceServicer.serve_stream` runs it): how a front end reads items
and writes answers (`StreamFrontEnd`), the credit window (`StreamWindow`), the order of
answers that carry no id (`AnswerOrder`), the room a stream's items wait for in a full lane
(`StreamRoom`, `RoomWaiter`), and the caller's receive limit (`ReceiveLimit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from google.protobuf.message import Message

from laneserve.server.codec import data_bytes, varint_bytes
from laneserve.server.config import ServerConfig
from laneserve.server.errors import (
    InvalidInputError,
    LaneserveError,
    bounded_message,
    to_rpc_status,
)
from laneserve.server.grpc_methods import OversizedRequest, answer_id, oversized
from laneserve.server.occupancy import Occupancy
from laneserve.v1 import inference_pb2 as pb

# A stream's items, their tags and answers, as one front end reads and writes them
# (`StreamFrontEnd`).
_Answer = TypeVar("_Answer", bound=Message)
_Item_contra = TypeVar("_Item_contra", contravariant=True)
_Tag = TypeVar("_Tag", bound="ItemTag")
_Queued = TypeVar("_Queued")

STREAM_DEFAULT_LANE = "bulk"


def stream_default_lane(config: ServerConfig) -> str:
    """The lane of a stream item that names no lane (nor a KServe priority):
    STREAM_DEFAULT_LANE where the config has it, else server.default_lane. Stated to
    Triton clients by ModelConfig (`kserve_config.STREAM_LANE_PARAMETER`)."""
    names = [lane.name for lane in config.lanes]
    return STREAM_DEFAULT_LANE if STREAM_DEFAULT_LANE in names else config.default_lane


# Stream call metadata (InferStream, ModelStreamInfer): the largest message the caller
# reads, where it is smaller than the server's max_message_bytes. gRPC ends the whole call
# on an answer the client will not read, every other item unanswered; sent this, the
# server answers such an item ANSWER_TOO_LARGE alone. Only the server knows an answer's
# size (an output's size may depend on its inputs), so the check lives here, not in the
# client.
RECEIVE_LIMIT_KEY = "laneserve-max-receive-bytes"
# The smallest limit taken: an error answer quoting a request_id fits in it.
MIN_RECEIVE_LIMIT_BYTES = 1024


class StreamRoom(Occupancy):
    """The items of one stream (InferStream, ModelStreamInfer) waiting for room in a full
    lane, or having their long text decoded (`InferenceServicer._decoded_aside`). While any
    is inside, the stream reads no more (`empty` unset): its producer is held back by gRPC's
    flow control, as by the credit window, and the server holds at most the items it had
    read."""


class StreamWindow:
    """One stream's credit window, on the event loop: the stream reads an item only
    while `open`; while it is not, the producer is held back by gRPC's flow control.

    Open while fewer than `items` of the stream's items are read and unanswered (their
    answers not yet written), and while its answers finished and not yet written (held
    for their order, `AnswerOrder`; queued; and the one gRPC is taking:
    `StreamFrontEnd.held_bytes`), with those of the items read and
    not yet finished counted at the largest answer the stream has had, come to under
    `answer_bytes`. Lanes bound the rows waiting to run, not the answers waiting to be
    written: counted in items alone, four streams whose caller stopped reading held 1 040
    answers of 1 MiB. Counted only once finished, answers of batches that took 100 ms
    were none while the reader read the whole window (256 of 1 MiB again). A fast
    reader's answers are written as they come, so it waits on the bytes only for what
    runs at once: `answer_bytes` of answers in flight. With nothing unanswered it is open
    whatever the bytes: an answer larger than `answer_bytes` is written alone, then the
    next is read.

    Before the stream's first answer holding any bytes, no answer's size is known: items
    not yet finished count at the largest item read (its tensor data, `sizing_by_items`),
    the one size known then. Counted at nothing, items read while the first answers were
    slow (a loaded server, a long first batch) were up to `items` of them: a stream
    whose first batch was held read all 100 of its 16 KiB items with a window of 1 000
    against a budget of 64 KiB (4 now). Where answers are smaller than items (a
    classifier), only the reading before the first answer is held back; where larger,
    the guess errs low until the first answer, as a larger answer than any before does.
    What gRPC's core takes off the connection before it is read is not counted here
    (its flow control's).

    The bound: an item is read only while the forecast is under `answer_bytes`; it errs only
    where an answer is larger than any before it (at most max_message_bytes: a larger answer
    is an error, `InferenceServicer._check_sendable`), or, before the first answer, larger
    than the largest item read."""

    def __init__(self, items: int, answer_bytes: int) -> None:
        self._items = items
        self._answer_bytes = answer_bytes
        self.unanswered = 0  # items read whose answer is not yet written
        self.unfinished = 0  # of them, those whose answer is not yet finished
        self.held_bytes = 0  # of the answers finished and not yet written
        self.largest_answer_bytes = 0  # of the stream's answers so far
        self.largest_item_bytes = 0  # of its items read while `sizing_by_items`
        self.open = asyncio.Event()
        self.open.set()

    @property
    def sizing_by_items(self) -> bool:
        """Whether `read` counts items at their own size: no answer held any bytes yet
        (refusals hold none: a stream whose first item was refused is still unmeasured)."""
        return self.largest_answer_bytes == 0

    def read(self, item_bytes: int = 0) -> None:
        """An item was read; `item_bytes`: its tensor data (`StreamFrontEnd.item_bytes`),
        needed only while `sizing_by_items`."""
        self.unanswered += 1
        self.unfinished += 1
        self.largest_item_bytes = max(self.largest_item_bytes, item_bytes)
        self._update()

    def finished(self, held_bytes: int) -> int:
        """An answer is queued to be written, holding `held_bytes` of tensor data (its
        front end's count, `StreamFrontEnd.held_bytes`); returns them, for `written`."""
        self.unfinished -= 1
        self.held_bytes += held_bytes
        self.largest_answer_bytes = max(self.largest_answer_bytes, held_bytes)
        self._update()
        return held_bytes

    def written(self, size: int) -> None:
        """gRPC has taken an answer of `size` bytes (`finished`'s): its credit and its
        bytes come back."""
        self.unanswered -= 1
        self.held_bytes -= size
        self._update()

    def _update(self) -> None:
        # Every held byte is an answer unanswered: with none, nothing is held.
        assert self.unanswered > 0 or self.held_bytes == 0
        each = self.largest_item_bytes if self.sizing_by_items else self.largest_answer_bytes
        forecast = self.held_bytes + self.unfinished * each
        has_room = self.unanswered < self._items and (
            self.unanswered == 0 or forecast < self._answer_bytes
        )
        if has_room:
            self.open.set()
        else:
            self.open.clear()


class AnswerOrder(Generic[_Queued]):
    """Puts one stream's finished answers on its queue (`put`), on the event loop: an
    answer tagged with its item's id at once; one that carries no id
    (`StreamFrontEnd.item_id` empty: its item had none, one over MAX_REQUEST_ID_BYTES, or
    bytes that do not parse) once the answers of every such item read before its own
    are put, so that those go out in the order their items were read, whatever their
    lanes. Their caller has no id to match them by and matches them by order, as
    Triton's clients do: Triton writes the answers of a model that is not decoupled
    (ModelConfig says laneserve's is not) in the order their requests came, and
    tritonclient's async_stream_infer sends no id by default. Answers with ids never
    wait behind them.

    An answer finished before an earlier one without an id is held here. Held, it is
    finished and not yet written: the credit window counts it (`StreamWindow.finished`),
    so an item that runs long holds the stream's reading, and the answers behind it, to
    `stream_answer_buffer_bytes`, as a caller that stops reading does. Every item read is
    answered (`InferenceServicer.serve_stream`), so every turn comes."""

    def __init__(self, put: Callable[[_Queued], None]) -> None:
        self._put = put
        self._read = 0  # items read whose answers carry no id: the next one's turn
        self._put_count = 0  # of them, those whose answer is put: the turn it waits for
        # Invariant: every key is over `_put_count` (that turn's answer is put at once).
        self._held: dict[int, _Queued] = {}

    def read(self, item_id: str) -> int | None:
        """An item whose answer carries `item_id` is read: its turn, for `finished` (None:
        its answer carries an id, and is put as it finishes)."""
        if item_id:
            return None
        self._read += 1
        return self._read - 1

    def finished(self, turn: int | None, answer: _Queued) -> None:
        """The answer of the item read as `turn` (`read`'s) is finished: it is put now, or
        once every earlier turn's is; after it, the held answers that waited on it alone."""
        if turn is None:
            self._put(answer)
            return
        assert self._put_count <= turn < self._read
        assert turn not in self._held
        self._held[turn] = answer
        while self._put_count in self._held:
            self._put(self._held.pop(self._put_count))
            self._put_count += 1


def held_answer_bytes(answer: pb.InferStreamResponse) -> int:
    """The bytes of an InferStream `answer`'s tensor data (an error's: none), from the
    shapes and dtypes the server encoded them with: reading `data`, or sizing the message,
    copies it (1 ms per MiB). A STRING output's `data` is read: its text sizes it."""
    # The server's own tensors: their dtype and shape always size them (never None).
    return sum(data_bytes(tensor) or 0 for tensor in answer.response.outputs)


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveLimit:
    """A stream caller's RECEIVE_LIMIT_KEY, where below the server's max_message_bytes.
    Every answer is sized as an InferStream item (`stream_item_bytes`), by the ledger's
    comparisons of its callers' limits too (`Caller.read_limit`): a front end whose stream
    sends an answer in a larger message says how much larger it may be."""

    limit_bytes: int  # as the caller sent it
    # The most the caller's stream answer takes over the same answer as an InferStream
    # item (`StreamFrontEnd.envelope_bytes`; InferStream's own: 0).
    envelope_bytes: int

    @property
    def item_bytes(self) -> int:
        """The largest answer, sized as an InferStream item, that reaches the caller."""
        return self.limit_bytes - self.envelope_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ItemTag:
    """What a stream reads of an item before `convert` (which may let go of it), for its
    run and its answer (`StreamFrontEnd.tag`); a front end's own tag adds what its answers
    need (`kserve_convert.ModelStreamTag`)."""

    # The id its answer is tagged with: empty where over MAX_REQUEST_ID_BYTES (`answer_id`;
    # refused for that).
    item_id: str
    # Whether the item's id is its request_id in the ledger's sense
    # (`InferenceServicer.run_request`): InferStream's always is; KServe's `id` only where
    # the item asks.
    idempotent: bool


class StreamFrontEnd(Protocol[_Item_contra, _Tag, _Answer]):
    """How one front end's stream reads its items and writes its answers: InferStream's
    (`InferStreamWire`) and KServe's ModelStreamInfer's (`kserve_convert.ModelStreamWire`).
    The rest is one mechanism for both (`InferenceServicer.serve_stream`): the credit
    window, room in a full lane, answers out of order (in order where they carry no id),
    one answer per item, cancel, drain, the receive limit and the streams' default lane."""

    def item_id(self, item: _Item_contra) -> str:
        """The id the item's answer carries (its tag's `item_id`), read as the item is
        read, for the order of the answers that carry none (`AnswerOrder`); its tag is
        read later, with `convert`. Never raises (it reads a field)."""
        ...

    def tag(self, item: _Item_contra) -> _Tag:
        """The item's tag, read before `convert` (which may let go of the item). Never
        raises (it reads fields only): an item's one answer, its error's too, needs it."""
        ...

    def convert(self, item: _Item_contra) -> pb.InferRequest | LaneserveError:
        """The item as laneserve's request, or its refusal, counted as Infer counts a
        request refused before it has a lane (one that does not parse). Raises a
        LaneserveError its item is answered with and counted nowhere (KServe's: a call for
        another model)."""
        ...

    def answer(self, tag: _Tag, response: pb.InferResponse) -> _Answer:
        """The answer of the item `tag`: `response`, already held to the server's limits in
        this front end's envelope (`InferenceServicer.widen_answer_envelope`) and to the
        caller's. Raises a LaneserveError the item is answered with instead (`error`):
        KServe's, an output its shared memory region no longer holds."""
        ...

    def error(self, tag: _Tag, error: LaneserveError, limit_bytes: int) -> _Answer:
        """The answer of the item `tag`: `error`, tagged with its id, within `limit_bytes`
        (the caller's receive limit, else max_message_bytes): gRPC sends no larger message
        (nor its client reads one), and ends the whole stream instead."""
        ...

    def held_bytes(self, answer: _Answer) -> int:
        """The bytes of tensor data `answer` (one of `answer`'s or `error`'s) holds, for
        the credit window (`StreamWindow`), without reading them."""
        ...

    def item_bytes(self, item: _Item_contra) -> int:
        """About the bytes of tensor data `item` carries, for the credit window's forecast
        before the stream's first answer (`StreamWindow.sizing_by_items`): InferStream's as
        its shapes size them (a shape that lies counts as it claims; refused, it holds its
        own stream to one item at a time until an answer holds bytes), ModelStreamInfer's
        as received; 0 for an item refused unread. Never raises. Asked only then: it may
        read a STRING tensor's data (a copy)."""
        ...

    def envelope_bytes(self, limit_bytes: int) -> int:
        """The most an answer within `limit_bytes` takes in this stream over the same
        answer as an InferStream item (`ReceiveLimit`)."""
        ...


class InferStreamWire:
    """InferStream's items and answers (`StreamFrontEnd`): laneserve.v1's InferRequest
    read as Infer reads it (`read_infer_request`), each answer an InferStreamResponse."""

    def item_id(self, item: pb.InferRequest | OversizedRequest) -> str:
        return answer_id(item.request_id)

    def tag(self, item: pb.InferRequest | OversizedRequest) -> ItemTag:
        return ItemTag(self.item_id(item), idempotent=True)

    def convert(self, item: pb.InferRequest | OversizedRequest) -> pb.InferRequest | LaneserveError:
        # Refused unread: only its id was kept, for its answer.
        return oversized(item) if isinstance(item, OversizedRequest) else item

    def answer(self, tag: ItemTag, response: pb.InferResponse) -> pb.InferStreamResponse:
        message = pb.InferStreamResponse(request_id=response.request_id)
        # CopyFrom, not the constructor: 3x cheaper for large outputs under upb.
        message.response.CopyFrom(response)
        return message

    def error(
        self, tag: ItemTag, error: LaneserveError, limit_bytes: int
    ) -> pb.InferStreamResponse:
        # A message that quotes long fields (a lane's name) is cut to fit.
        status = to_rpc_status(error)
        answer = pb.InferStreamResponse(request_id=tag.item_id, error=status)
        excess = answer.ByteSize() - limit_bytes
        if excess > 0:  # only at a small limit: messages are ~1 KiB at most
            message = status.message
            answer.error.message = bounded_message(message, len(message.encode()) - excess)
            # The id and the details take at most ~400 of the 1024 bytes it is at least.
            assert answer.ByteSize() <= limit_bytes
        return answer

    def held_bytes(self, answer: pb.InferStreamResponse) -> int:
        return held_answer_bytes(answer)

    def item_bytes(self, item: pb.InferRequest | OversizedRequest) -> int:
        # As its shapes size it (None: a shape or dtype refused, sized as nothing).
        if isinstance(item, OversizedRequest):
            return 0
        return sum(data_bytes(tensor) or 0 for tensor in item.inputs)

    def envelope_bytes(self, limit_bytes: int) -> int:
        return 0  # its answers are InferStream items


INFER_STREAM_WIRE = InferStreamWire()


class RoomWaiter:
    """A stream item in its lane's line for room (see `InferenceServicer._wait_for_room`),
    on the event loop. It sleeps until woken: by its turn, the drain, or a call with its key
    in the ledger beginning (it joins). Each waiter woke every `service.ROOM_POLL_MAX_S` for
    its whole wait to look at the last two: 2 500 waiting kept an idle server at 63 % of a
    core."""

    def __init__(self) -> None:
        self.oldest = False  # its turn: it alone looks for room, and is first in its line
        self._woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(self) -> None:
        if not self._woken.done():
            self._woken.set_result(None)

    async def sleep(self, timeout_s: float) -> None:
        """Until woken, or `timeout_s`; at once when woken since the last sleep."""
        if not self._woken.done():
            await asyncio.wait([self._woken], timeout=timeout_s)
        if self._woken.done():
            self._woken = asyncio.get_running_loop().create_future()


def stream_item_bytes(response: pb.InferResponse, response_bytes: int | None = None) -> int:
    """The size of `response` sent as an InferStream item (its request_id and the
    response, each a length-delimited field), computed without copying the outputs.
    `response_bytes`: its ByteSize(), where known already."""
    size = response.ByteSize() if response_bytes is None else response_bytes
    request_id = len(response.request_id.encode())
    return (
        1
        + varint_bytes(size)
        + size
        + (1 + varint_bytes(request_id) + request_id if request_id else 0)
    )


def parse_receive_limit(
    metadata: Iterable[tuple[str, str | bytes]] | None, config: ServerConfig
) -> int | None:
    """The largest stream item the caller reads, its RECEIVE_LIMIT_KEY, where it is below
    the server's max_message_bytes; None where it sent none, or no smaller one."""
    values = [value for key, value in metadata or () if key == RECEIVE_LIMIT_KEY]
    if not values:
        return None
    text = values[0].decode(errors="replace") if isinstance(values[0], bytes) else values[0]
    if len(values) > 1 or not (text.isascii() and text.isdigit()):
        raise _receive_limit_refusal(values)
    digits = text.lstrip("0")
    if len(digits) > 18:  # noqa: PLR2004 - over any message limit
        return None  # not converted: Python refuses to over 4 300 digits
    limit = int(digits or "0")
    if limit < MIN_RECEIVE_LIMIT_BYTES:
        raise _receive_limit_refusal(values)
    return limit if limit < config.max_message_bytes else None


def _receive_limit_refusal(values: Sequence[str | bytes]) -> InvalidInputError:
    return InvalidInputError(
        f"call metadata {RECEIVE_LIMIT_KEY} is {[*values]!r}; expected one whole number of "
        f"bytes, at least {MIN_RECEIVE_LIMIT_BYTES}"
    )
