"""Triton's system shared memory extension (KServe v2 / Triton clients, server/kserve.py):
named regions of POSIX shared memory objects that a caller on this host created
(shm_open) and registered, from which ModelInfer reads an input's bytes and into which
it writes an output's, instead of carrying them in gRPC messages. A BYTES tensor's
bytes there are its raw encoding (each element a 4-byte length and its bytes, as
tritonclient's serialize_byte_tensor writes them), its byte_size that encoding's size:
an output's is known once it has run, and must fit its placement then.

A region is `byte_size` bytes at `offset` of the object `key` (a file of /dev/shm), its
file held open while it is registered. Its bytes are read and written with pread and
pwrite, not mapped: a caller's object may be sparse on a full tmpfs or shrink under a
mapping, and an access to a mapping there faults the whole server (SIGBUS), where a
pread comes back short and a pwrite fails ENOSPC, refused to that request; and a
mapping costs address space for every byte registered, a sparse object nothing else
(53 regions of 64 TiB left a 4 MiB request no room). What a request reads is copied out
when it is converted, as a message's bytes are: a queued request holds its own copy, an
unregister never pulls bytes from under it, and the caller may write the region again
once it has its answer (Triton's rule too). An output goes in when the answer is
written, into the region its request was checked against, or nowhere: one
unregistered meanwhile (registered again or not: another object, perhaps another
caller's) fails that request's answer NOT_FOUND, saying so.

Bounds: `region_limit()` regions, each one open file. An input's bytes from shared
memory count toward max_message_bytes with the message's own (`InputBudget`): a request
holds what it read however it came, and what admission and the memory watermark budget
is what requests hold. Who may: callers on this host (loopback peers, `is_local_peer`)
while server.shared_memory is true (false by default). A region is a file of this
host's memory: a caller elsewhere has no use for one, and reaches none.
Among the callers that look local, as in Triton's server, any may register an object
the server's user may read and write, use any region by its name, and unregister any;
and a proxy on the host (a service mesh's sidecar connects from 127.0.0.6) makes every
caller behind it look local. Hence off unless an operator turns it on.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote

# config.py's own check of a model's name, shared: a region's name follows its rule.
from laneserve.server.config import MODEL_NAME_RULE, name_problem
from laneserve.server.errors import (
    InvalidInputError,
    RegionExistsError,
    RegionLimitError,
    RegionNotFoundError,
    SharedMemoryRefusedError,
)
from laneserve.server.log_events import log_event
from laneserve.server.process import open_file_limit

if TYPE_CHECKING:  # annotations only: importing the generated module registers package
    # `inference` in protobuf's pool, which tritonclient's would clash with
    from laneserve.kserve import grpc_predict_v2_pb2 as kpb

log = logging.getLogger(__name__)

# Where Linux keeps POSIX shared memory objects: shm_open("/name") opens /dev/shm/name.
SHM_DIRECTORY: Final = Path("/dev/shm")  # noqa: S108 - the system's, not a temporary file
# The most regions registered at once (each an open file), where the process's open-file
# limit leaves room for it (`region_limit`).
MAX_REGIONS: Final = 1024
# The share of the open-file limit regions may hold: the rest is the server's own files
# and its client connections (one each).
_REGION_SHARE_OF_FILES: Final = 4
# The longest object name (NAME_MAX, less nothing: the leading "/" is not in the file's).
MAX_KEY_BYTES: Final = 255
# Triton's tensor parameters placing an input's or output's bytes in a region: its name
# (string_param), the bytes (int64_param), and where in the region they start
# (int64_param, default 0). uint64_param is taken for the two sizes too.
REGION_PARAMETER: Final = "shared_memory_region"
BYTE_SIZE_PARAMETER: Final = "shared_memory_byte_size"
OFFSET_PARAMETER: Final = "shared_memory_offset"
_PARAMETERS: Final = (REGION_PARAMETER, BYTE_SIZE_PARAMETER, OFFSET_PARAMETER)
_SIZE_KINDS: Final = ("int64_param", "uint64_param")
# The most parameter names a refusal quotes.
_MAX_NAMED: Final = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where a tensor's bytes are: `byte_size` bytes at `offset` of region `region`."""

    region: str
    offset: int
    byte_size: int

    @property
    def end(self) -> int:
        return self.offset + self.byte_size


@dataclasses.dataclass(eq=False, slots=True)
class Region:
    """A registered region: its object's file, open for reading and writing."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int

    def close(self) -> None:
        os.close(self.fd)


def region_limit() -> int:
    """The most regions registered at once: MAX_REGIONS, or a quarter of the process's
    open-file limit where that is less (a soft limit of 1 024, systemd's default, left
    no file for new connections after 500 regions of two files each)."""
    limit = open_file_limit()
    if limit is None:
        return MAX_REGIONS
    return max(1, min(MAX_REGIONS, limit // _REGION_SHARE_OF_FILES))


def placement_of(what: str, parameters: Mapping[str, kpb.InferParameter]) -> Placement | None:
    """The placement a tensor's parameters give, None without any; `what` names the
    tensor in refusals ("input 'x'"). Raises InvalidInputError on any other parameter,
    a parameter of another kind, or a size without a region (as Triton's server)."""
    if not parameters:
        return None
    unknown = sorted(key for key in parameters if key not in _PARAMETERS)
    if unknown:
        raise InvalidInputError(
            f"{what} has parameters {unknown[:_MAX_NAMED]}; expected none, or Triton's "
            f"shared memory ones: {REGION_PARAMETER!r} (string_param), "
            f"{BYTE_SIZE_PARAMETER!r} and optionally {OFFSET_PARAMETER!r} (int64_param or "
            "uint64_param); "
            "laneserve reads no other (no classification; binary_data, on the HTTP wire alone)"
        )
    if REGION_PARAMETER not in parameters:
        raise InvalidInputError(
            f"{what} has {sorted(parameters)} without {REGION_PARAMETER!r}; expected the "
            "region's name with them (Triton's shared memory parameters)"
        )
    region = _value(what, REGION_PARAMETER, parameters[REGION_PARAMETER], ("string_param",))
    assert isinstance(region, str)
    if BYTE_SIZE_PARAMETER not in parameters:
        raise InvalidInputError(
            f"{what} has {REGION_PARAMETER!r} without {BYTE_SIZE_PARAMETER!r}; expected both "
            "(the bytes of the tensor in the region)"
        )
    byte_size = _value(what, BYTE_SIZE_PARAMETER, parameters[BYTE_SIZE_PARAMETER], _SIZE_KINDS)
    offset: object = 0
    if OFFSET_PARAMETER in parameters:
        offset = _value(what, OFFSET_PARAMETER, parameters[OFFSET_PARAMETER], _SIZE_KINDS)
    assert isinstance(byte_size, int)
    assert isinstance(offset, int)
    for key, value in ((BYTE_SIZE_PARAMETER, byte_size), (OFFSET_PARAMETER, offset)):
        if value < 0:
            raise InvalidInputError(f"{what} has {key} {value}; expected bytes >= 0")
    return Placement(region, offset, byte_size)


def _value(what: str, key: str, parameter: kpb.InferParameter, kinds: tuple[str, ...]) -> object:
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in kinds:
        given = "unset" if kind is None else kind
        raise InvalidInputError(
            f"{what}'s parameter {key!r} is {given}; expected {' or '.join(kinds)}"
        )
    value: object = getattr(parameter, kind)
    return value


def is_local_peer(peer: str) -> bool:
    """Whether gRPC's `peer` ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000",
    "unix:/run/x.sock") is on this host: a loopback address (an IPv4-mapped IPv6 one
    too), or a Unix socket (were the server to listen on one: it listens on TCP)."""
    kind, _, address = unquote(peer).partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = address.rpartition(":")[0].strip("[]").partition("%")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


class InputBudget:
    """What a request's inputs may still read from shared memory: max_message_bytes less
    the message's own bytes and what its other inputs read, so that a request holds no
    more than one sent whole could."""

    def __init__(self, max_bytes: int, message_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.left = max_bytes - message_bytes

    def take(self, what: str, byte_size: int) -> None:
        if byte_size > self.left:
            raise InvalidInputError(
                f"{what} asks for {byte_size} bytes of shared memory, over the "
                f"{max(self.left, 0)} left of the request's max_message_bytes "
                f"({self.max_bytes}, the message and its other inputs counted); expected a "
                "request's tensors within it however they come (server.max_message_bytes)"
            )
        self.left -= byte_size


@dataclasses.dataclass(frozen=True, slots=True)
class SharedMemoryCounts:
    """What the metrics read of the registry at a scrape (`SharedMemoryRegions.counts`)."""

    regions: int  # registered now
    read_bytes: int  # inputs' bytes read out of regions since the server started
    written_bytes: int  # outputs' bytes written into regions since the server started


class SharedMemoryRegions:
    """The regions registered on this server (one registry, every port's), used from the
    event loop only, but for `counts` (the metric reader's thread)."""

    def __init__(self, *, enabled: bool, directory: Path = SHM_DIRECTORY) -> None:
        self.enabled = enabled
        self._directory = directory
        self._regions: dict[str, Region] = {}
        self._limit = region_limit()
        # Bytes each pread took out of a region and each pwrite put into one, for the
        # metrics. Plain ints, written on the event loop alone (one writer: no update is
        # lost) and read by the metric reader's thread (`counts`): reading an int
        # attribute is atomic in CPython, and a scrape that reads one an update late
        # reads it at the next. No lock on the request path.
        self.read_bytes = 0
        self.written_bytes = 0

    def check_peer(self, peer: str) -> None:
        """Raises SharedMemoryRefusedError unless `peer` may use shared memory here."""
        if not self.enabled:
            raise SharedMemoryRefusedError(
                "shared memory is off on this server (server.shared_memory = false, the "
                "default; `laneserve serve --shared-memory` turns it on); expected the "
                "tensors' bytes in the request and its answer"
            )
        if not is_local_peer(peer):
            raise SharedMemoryRefusedError(
                f"shared memory is for callers on the server's host, and this call comes "
                f"from {unquote(peer)!r}; expected a loopback connection (a "
                "region is a file of the server's /dev/shm), or the tensors' bytes in the "
                "request and its answer"
            )

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Registers `byte_size` bytes at `offset` of object `key` as region `name`, its
        file held open."""
        # A model name's rule, on either wire (gRPC's name field, HTTP's path): a name is
        # quoted in each request that uses it, and back in status answers, logs and
        # refusals, where a control character has no place ("\x00\n" was registered).
        problem = name_problem(name)
        if problem is not None:
            raise InvalidInputError(f"region name is {problem}; expected {MODEL_NAME_RULE}")
        if name in self._regions:
            held = self._regions[name]
            raise RegionExistsError(
                f"region {name!r} is registered already (key {held.key!r}, "
                f"{held.byte_size} bytes at offset {held.offset}); expected it unregistered "
                "first, or another name"
            )
        if len(self._regions) >= self._limit:
            raise RegionLimitError(
                f"{self._limit} regions are registered, the most this server holds (one open "
                "file each, within its open-file limit); expected one unregistered first"
            )
        if byte_size < 1:
            raise InvalidInputError(
                f"region {name!r} has byte_size {byte_size}; expected 1 byte or more"
            )
        path = self._directory / _file_name(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                raise RegionLimitError(
                    f"the server has no file left to open shared memory object {key!r} "
                    f"({error.strerror}); expected a region unregistered first, or a higher "
                    "open-file limit for the server (`ulimit -n`)"
                ) from None
            raise InvalidInputError(
                f"shared memory object {key!r} cannot be opened for reading and writing "
                f"({error.strerror}: {path}); expected the key of an object the caller "
                "created with shm_open on the server's host, which the server's user may "
                "read and write"
            ) from None
        try:
            _check_object(name, key, offset, byte_size, fd)
        except BaseException:
            os.close(fd)
            raise
        self._regions[name] = Region(name, key, offset, byte_size, fd)
        # DEBUG: a caller may register and unregister a region per request.
        log_event(
            log,
            logging.DEBUG,
            "shared_memory_registered",
            f"shared memory region {name!r} registered",
            region=name,
            key=key,
            offset=offset,
            byte_size=byte_size,
        )

    def unregister(self, name: str) -> None:
        """Lets go of region `name` ("" every region); a name not registered is no error
        (as Triton's server: a caller cleans up without asking first)."""
        names = list(self._regions) if not name else [name] if name in self._regions else []
        for each in names:
            self._regions.pop(each).close()
            log_event(
                log,
                logging.DEBUG,
                "shared_memory_unregistered",
                f"shared memory region {each!r} unregistered",
                region=each,
            )

    def get(self, name: str) -> Region | None:
        """Region `name`, None where none is registered under it."""
        return self._regions.get(name)

    def status(self, name: str) -> list[Region]:
        """Region `name`, or every region for ""; raises RegionNotFoundError for a name
        not registered."""
        if not name:
            return list(self._regions.values())
        if name not in self._regions:
            raise RegionNotFoundError(
                f"no region {name!r} is registered; expected one of "
                f"{sorted(self._regions)[:_MAX_NAMED]} (name '' lists them all)"
            )
        return [self._regions[name]]

    def read(self, placement: Placement, what: str) -> bytes:
        """A copy of the bytes `placement` names (checked: `checked_region`)."""
        region = self.checked_region(placement, what)
        start = region.offset + placement.offset
        data = os.pread(region.fd, placement.byte_size, start)
        self.read_bytes += len(data)
        parts = [data]
        read = len(data)
        while data and read < placement.byte_size:  # a pread may come back short
            data = os.pread(region.fd, placement.byte_size - read, start + read)
            self.read_bytes += len(data)
            parts.append(data)
            read += len(data)
        if read < placement.byte_size:  # shrunk since `checked_region` looked
            raise _shrunk(region, start + read)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def write(self, placement: Placement, data: bytes, what: str, region: Region | None) -> None:
        """`data` into the region at `placement`, which must hold it, and be `region`, the
        one registered under its name when the request was converted (None: none was):
        a region unregistered meanwhile, or registered again (another object, perhaps
        another caller's), refuses the write."""
        if len(data) > placement.byte_size:
            raise output_too_large(what, f"{len(data)} bytes", placement)
        if region is None or self._regions.get(placement.region) is not region:
            raise RegionNotFoundError(
                f"{what} is placed in region {placement.region!r}, which was unregistered "
                "while its request ran (a region registered under that name since is "
                "another); expected the region kept registered until its requests are "
                "answered"
            )
        region = self.checked_region(placement, what)
        start = region.offset + placement.offset
        view = memoryview(data)
        try:
            while view:  # a pwrite may write less than asked
                written = os.pwrite(region.fd, view, start)
                self.written_bytes += written
                view, start = view[written:], start + written
        except OSError as error:
            raise InvalidInputError(
                f"{what} could not be written into region {region.name!r} (shared memory "
                f"object {region.key!r}: {error.strerror}); expected an object whose "
                "memory its filesystem holds (a /dev/shm that is full cannot hold the pages "
                "a sparse object never wrote)"
            ) from None

    def checked_region(self, placement: Placement, what: str) -> Region:
        """The region `placement` names, once `placement` is checked to lie within it
        and the region's object to still hold it; raises RegionNotFoundError where none
        is registered under its name (NOT_FOUND, as Triton's server), else
        InvalidInputError."""
        region = self._regions.get(placement.region)
        if region is None:
            raise RegionNotFoundError(
                f"{what} is placed in region {placement.region!r}, which is not registered; "
                f"expected a region registered by SystemSharedMemoryRegister (registered: "
                f"{sorted(self._regions)[:_MAX_NAMED]})"
            )
        if placement.end > region.byte_size:
            raise InvalidInputError(
                f"{what} is placed at bytes {placement.offset} to {placement.end} of region "
                f"{region.name!r}, which has {region.byte_size}; expected "
                f"{OFFSET_PARAMETER} + {BYTE_SIZE_PARAMETER} within the region"
            )
        size = os.fstat(region.fd).st_size
        if size < region.offset + region.byte_size:
            raise _shrunk(region, size)
        return region

    def counts(self) -> SharedMemoryCounts:
        """The regions registered now and the bytes moved so far; called on the metric
        reader's thread, which the loop's updates never wait for: len() of a dict is one
        read of its size, as atomic as an int's. Each figure is one the loop held; the
        three are not read at one instant, which no gauge or rate needs."""
        return SharedMemoryCounts(len(self._regions), self.read_bytes, self.written_bytes)

    def close(self) -> None:
        """Lets go of every region (the server stops)."""
        self.unregister("")


class CallerRegions:
    """The server's regions as one call may use them: its caller's `peer` decides
    whether it may (`SharedMemoryRegions.check_peer`), judged once, and only for a call
    that places a tensor in a region (a stream's items share their call's)."""

    def __init__(self, regions: SharedMemoryRegions, peer: str, max_message_bytes: int) -> None:
        self.regions = regions
        self.peer = peer
        self.max_message_bytes = max_message_bytes
        self._may = False

    def usable(self) -> SharedMemoryRegions:
        """The regions; raises SharedMemoryRefusedError where this caller may not."""
        if not self._may:
            # Once: a parse took ~5 us (measured once by hand), per placed tensor before.
            self.regions.check_peer(self.peer)
            self._may = True
        return self.regions


def _file_name(key: str) -> str:
    """The file of /dev/shm that shm_open(key) opens: the key less its leading slashes.
    Raises InvalidInputError for a key shm_open would refuse or that names no file of
    that directory alone."""
    name = key.lstrip("/")
    if (
        not name
        or "/" in name
        or "\0" in name
        or name in (".", "..")
        or len(name.encode()) > MAX_KEY_BYTES
    ):
        raise InvalidInputError(
            f"shared memory key {key!r} is no shm_open name; expected '/' and then 1 to "
            f"{MAX_KEY_BYTES} bytes without '/' (as tritonclient's create_shared_memory_region "
            "takes it: '/input0')"
        )
    return name


def output_too_large(what: str, size: str, placement: Placement) -> InvalidInputError:
    """The refusal of an output of `size` (its bytes, in words) over its placement: known
    before its request runs (`kserve_convert._check_output_room`), or once written (`write`)."""
    return InvalidInputError(
        f"{what} is {size}, over the {placement.byte_size} of its {BYTE_SIZE_PARAMETER} in "
        f"region {placement.region!r}; expected a byte_size that holds the output (its rows "
        "times the bytes of a row; a BYTES output's elements, each a 4-byte length and its "
        "bytes)"
    )


def _shrunk(region: Region, size: int) -> InvalidInputError:
    return InvalidInputError(
        f"region {region.name!r}'s object {region.key!r} is now {size} bytes, short of the "
        f"{region.offset + region.byte_size} it had when registered; expected the object "
        "kept at its size while registered"
    )


def _check_object(name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
    """Refuses an object that is not a regular file, or does not hold the region."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(
            f"shared memory object {key!r} is not a regular file; expected an object "
            "created with shm_open"
        )
    if offset + byte_size > info.st_size:
        raise InvalidInputError(
            f"region {name!r} asks for bytes {offset} to {offset + byte_size} of shared "
            f"memory object {key!r}, which has {info.st_size}; expected offset + byte_size "
            "within the object (its size as set by ftruncate)"
        )
