"""Which model and which server build answer: `ModelIdentity` (GetModel's, the start-up
line's, laneserve_build_info's) and `SERVER_VERSION`.

The model's hash covers the files the session reads: the model file, then each external
data file it names. Those names are found by walking the model's protobuf by hand, field
by field, looking only into the messages that can hold tensors: `onnx.load` would parse
the whole model, inline weights included, into the serving process's memory (why the
static estimate runs in a child: static_estimate), and ONNX Runtime does not say which
files it read. tests/test_server.py checks the walk against onnx's own
external_data_helper, on models with their data in one file, one file per tensor, and
inline.

Nothing here imports onnxruntime: the engine reads the model's metadata from its session
and hands it over (`ModelMetadata`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import logging
import mmap
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from laneserve.server.log_events import log_event

log = logging.getLogger(__name__)

# The laneserve package's version: GetModel's server_version, laneserve_build_info's.
try:
    SERVER_VERSION = importlib.metadata.version("laneserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
    SERVER_VERSION = "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Which model the session runs, read once at start: GetModel reports it and the
    start-up line names it, so a rollout can be checked and an answer traced to a model."""

    # Hex SHA-256 of the model file followed by its external data files, whole, in the
    # order the model first names them (see `model_files`); "" when it could not be
    # worked out, or a file changed while the session loaded it (logged:
    # model_hash_unavailable).
    sha256: str
    # The model's own metadata (ONNX's ModelProto, as ONNX Runtime reads it): None / ""
    # where the model sets none.
    version: int | None
    producer_name: str
    graph_name: str
    domain: str
    description: str  # cut to DESCRIPTION_MAX_BYTES
    # metadata_props, bounded (`_bounded_metadata`).
    custom_metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)


class ModelMetadata(Protocol):
    """The model's metadata as ONNX Runtime reads it (`session.get_modelmeta()`)."""

    @property
    def version(self) -> int: ...
    @property
    def producer_name(self) -> str: ...
    @property
    def graph_name(self) -> str: ...
    @property
    def domain(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def custom_metadata_map(self) -> Mapping[str, str]: ...


# The model author's text kept for GetModel, in UTF-8 bytes: metadata_props' keys and
# values together, and the description. GetModel's answer is the operator's; a model may
# carry a whole config or tokenizer there (tens of KiB), which no answer needs.
CUSTOM_METADATA_MAX_BYTES = 8 * 1024
DESCRIPTION_MAX_BYTES = 1024
# The hash reads this much at a time: memory stays bounded whatever the model's size.
_HASH_CHUNK_BYTES = 1 << 20
# Where an ONNX model's tensors can name external data files: per message, the fields
# (ONNX's numbers) that hold messages to look into. A tensor's field 13 holds its
# external_data entries (key 1, value 2), whose "location" is a file beside the model,
# read only where its field 14, data_location, is EXTERNAL (1).
_MODEL, _GRAPH, _FUNCTION, _NODE, _ATTRIBUTE, _SPARSE, _TENSOR = range(7)
_HOLDS: dict[int, dict[int, int]] = {
    _MODEL: {7: _GRAPH, 25: _FUNCTION},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _FUNCTION: {7: _NODE},
    _NODE: {5: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
}
_TENSOR_EXTERNAL_DATA = 13
_TENSOR_DATA_LOCATION = 14
_EXTERNAL = 1
# A varint's tenth byte holds its bits 63 and up: protobuf writes none longer.
_VARINT_MAX_SHIFT = 63
# ONNX Runtime's model version of a model that sets none (its kNoVersion, INT64_MAX); a
# model_version set to 0 reads 0.
_NO_MODEL_VERSION = 2**63 - 1
# A file's identity as fstat gives it: the same before the session loaded it and when it
# is hashed, or the hash would not be of what was loaded (a touch too: mtime).
_FileIdentity = tuple[int, int, int, int]
# The files the session reads the model from, each with its identity (`model_files`).
ModelFiles = Sequence[tuple[Path, _FileIdentity]]


def find_model_files(model_path: str) -> ModelFiles | None:
    """`model_files`, or None, warned about, when they cannot be worked out: a file the
    session cannot load either is refused next, with the runtime's words. Called before
    the session reads the model (see `model_identity`)."""
    try:
        return model_files(model_path)
    except (OSError, ValueError) as error:
        _warn_hash_unavailable(model_path, str(error))
        return None


def model_identity(model_path: str, files: ModelFiles | None, meta: ModelMetadata) -> ModelIdentity:
    """The served model's identity: the hash of `files`, found before the session read
    them and hashed after it has (the session's read warmed the page cache), and the
    session's metadata `meta`, bounded. Never raises for the hash: the session loaded the
    model, so it is served, with an empty hash where the files' could not be read or
    were not those found (`_hash_files`)."""
    custom_metadata, left_out = _bounded_metadata(meta.custom_metadata_map)
    if left_out:
        log_event(
            log,
            logging.WARNING,
            "model_metadata_left_out",
            f"model {model_path}: {len(left_out)} metadata_props entries left out "
            f"of GetModel (over {CUSTOM_METADATA_MAX_BYTES} bytes together): "
            f"{_cut(', '.join(left_out), 300)}",
            model=model_path,
            left_out=left_out[:100],
        )
    return ModelIdentity(
        sha256="" if files is None else _hash_files(model_path, files),
        version=None if meta.version == _NO_MODEL_VERSION else meta.version,
        producer_name=meta.producer_name,
        graph_name=meta.graph_name,
        domain=meta.domain,
        description=_cut(meta.description, DESCRIPTION_MAX_BYTES),
        custom_metadata=custom_metadata,
    )


def model_files(model_path: str) -> ModelFiles:
    """The files the session reads the model from: the model file, then its external data
    files (resolved beside it, as ONNX Runtime resolves them), with their identities,
    each read from the open file as the hash reads it (`_hash_files`). OSError or
    ValueError when they cannot be worked out, or one is not a regular file."""
    path = Path(model_path)
    with _open_regular(path) as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        identity = _file_identity(file)
        try:
            locations = _external_locations(data)
        except (IndexError, RecursionError) as error:
            raise ValueError(f"not a well-formed ONNX model file ({error!r})") from error
    found = [(path, identity)]
    for location in locations:
        with _open_regular(path.parent / location) as file:
            found.append((path.parent / location, _file_identity(file)))
    return found


def _open_regular(path: Path) -> io.FileIO:
    """`path` opened to read, unbuffered. ValueError when it is not a regular file: a
    FIFO's open waits for a writer (the start would hang), a directory or a device holds
    no model. Such a file is refused by its path, never opened; the file opened is
    checked again, O_NONBLOCK so that a FIFO put in its place meanwhile opens at once
    (a regular file's reads ignore it)."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise ValueError(f"{path} is not a regular file")
    file = io.FileIO(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
        file.close()
        raise ValueError(f"{path} is not a regular file")
    return file


def _file_identity(file: io.FileIO) -> _FileIdentity:
    status = os.fstat(file.fileno())
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def read_varint(data: mmap.mmap, position: int) -> tuple[int, int]:
    """The protobuf varint at `position`, and the position after it. ValueError past its
    tenth byte: read on, a run of bytes >= 0x80 (garbage, not a model) would grow one
    number as long as the run, in time quadratic in its length."""
    value = shift = 0
    start = position
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:  # noqa: PLR2004 - the continuation bit
            return value, position
        shift += 7
        if shift > _VARINT_MAX_SHIFT:
            raise ValueError(f"a protobuf varint at byte {start} runs past 10 bytes")


def write_varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf varint."""
    encoded = bytearray()
    while value >= 0x80:  # noqa: PLR2004 - the continuation bit
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


# The wire type of length-delimited fields: strings, bytes, messages, packed repeats.
LENGTH_DELIMITED = 2


class ProtobufField(NamedTuple):
    """One field of a protobuf message as the wire holds it (`protobuf_fields`)."""

    number: int
    wire_type: int  # 0 varint, 1 fixed 64 bits, 2 length-delimited, 5 fixed 32 bits
    value: int  # a varint's value, a length-delimited field's length; 0 for fixed
    start: int  # the tag's first byte
    value_start: int  # the value's first byte (after a length-delimited field's length)
    end: int  # the byte after the field


def protobuf_fields(data: mmap.mmap, start: int, end: int) -> Iterator[ProtobufField]:
    """The fields of the protobuf message in `data[start:end]`, in the order written,
    each read up to its value, never into it: a 2 GiB weight is one field stepped over.
    ValueError (or IndexError) when the message is not well-formed: one of zeros (field
    0, which protobuf never writes) is refused at its first byte, not stepped through a
    byte at a time. model_identity and static_estimate walk a model with it."""
    position = start
    while position < end:
        tag_start = position
        tag, position = read_varint(data, position)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise ValueError(f"protobuf field number 0 at byte {tag_start}")
        value = 0
        value_start = position
        if wire_type == 0:
            value, position = read_varint(data, position)
        elif wire_type in (1, 5):  # fixed 64 and 32 bits
            position += 8 if wire_type == 1 else 4
        elif wire_type == LENGTH_DELIMITED:  # groups are not ONNX's
            value, value_start = read_varint(data, position)
            position = value_start + value
            if position > end:
                raise ValueError(f"a field at byte {value_start} runs past its message")
        else:
            raise ValueError(f"protobuf wire type {wire_type} at byte {position}")
        yield ProtobufField(number, wire_type, value, tag_start, value_start, position)
    if position != end:
        raise ValueError(f"a field at byte {position} runs past its message")


def _external_locations(data: mmap.mmap) -> list[str]:
    """The external data locations an ONNX model file's tensors read, each once, in the
    order they first appear. The protobuf is walked, not parsed: only the messages that
    can hold tensors are looked into, every other field (weights stored inline included)
    is skipped unread, so a 2 GiB model costs neither its size in memory nor its reading.
    ValueError (or IndexError) when the file is not a well-formed protobuf: one of zeros
    (field 0, which protobuf never writes) is refused at its first byte, not stepped
    through a byte at a time."""
    locations: dict[str, None] = {}

    def walk(kind: int, start: int, end: int) -> None:
        # A tensor's data is in its "location" (the last, as ONNX Runtime reads them)
        # only where its data_location is EXTERNAL (ONNX Runtime's test, and onnx's
        # uses_external_data): entries left beside inline data name no file the session
        # reads. The two fields may come in either order.
        location: str | None = None
        external = False
        for field in protobuf_fields(data, start, end):
            if field.wire_type == 0:
                if kind == _TENSOR and field.number == _TENSOR_DATA_LOCATION:
                    external = field.value == _EXTERNAL
            elif field.wire_type != LENGTH_DELIMITED:
                continue
            elif kind == _TENSOR and field.number == _TENSOR_EXTERNAL_DATA:
                key, entry = _string_entry(data, field.value_start, field.end)
                if key == "location":
                    location = entry
            elif (inner := _HOLDS.get(kind, {}).get(field.number)) is not None:
                walk(inner, field.value_start, field.end)
        if external and location is not None:
            locations.setdefault(location)

    walk(_MODEL, 0, len(data))
    return list(locations)


def _string_entry(data: mmap.mmap, start: int, end: int) -> tuple[str, str]:
    """The key and value of ONNX's StringStringEntryProto in `data[start:end]`."""
    fields = {1: "", 2: ""}
    for field in protobuf_fields(data, start, end):
        if field.wire_type != LENGTH_DELIMITED:  # both fields are strings
            raise ValueError(f"an external_data entry at byte {start} holds a non-string")
        fields[field.number] = data[field.value_start : field.end].decode()
    return fields[1], fields[2]


def _hash_files(model_path: str, files: ModelFiles) -> str:
    """Hex SHA-256 of the files' bytes one after the other, read a chunk at a time; ""
    when a file is no longer the one `files` found (replaced, written to or touched
    since: the hash might not be of the model the session loaded) or cannot be read,
    warned about. Never a refusal: the session loaded the model, whichever it was."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    for path, identity in files:
        try:
            with _open_regular(path) as file:
                if _file_identity(file) != identity:
                    _warn_hash_unavailable(
                        model_path,
                        f"{path} changed while loading (replaced, written to or touched "
                        "after it was found)",
                    )
                    return ""
                while read := file.readinto(buffer):
                    digest.update(view[:read])
        except (OSError, ValueError) as error:
            # A read's OSError names no file, an open's does.
            named = isinstance(error, ValueError) or error.filename is not None
            _warn_hash_unavailable(model_path, str(error) if named else f"{path}: {error}")
            return ""
    return digest.hexdigest()


def _warn_hash_unavailable(model_path: str, why: str) -> None:
    log_event(
        log,
        logging.WARNING,
        "model_hash_unavailable",
        f"cannot hash model {model_path}: {why}; GetModel's model_sha256 is empty",
        model=model_path,
        error=why,
    )


def _cut(text: str, max_bytes: int) -> str:
    """`text`, or its start ending in "…" within `max_bytes` of UTF-8."""
    encoded = text.encode()
    if len(encoded) <= max_bytes:
        return text
    return encoded[: max_bytes - len("…".encode())].decode(errors="ignore") + "…"


def _bounded_metadata(props: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The entries kept, in key order while their keys and values together stay within
    CUSTOM_METADATA_MAX_BYTES of UTF-8, and the keys of those left out."""
    kept: dict[str, str] = {}
    left_out: list[str] = []
    used_bytes = 0
    for key in sorted(props):
        size = len(key.encode()) + len(props[key].encode())
        if used_bytes + size > CUSTOM_METADATA_MAX_BYTES:
            left_out.append(key)
            continue
        kept[key] = props[key]
        used_bytes += size
    return kept, left_out
