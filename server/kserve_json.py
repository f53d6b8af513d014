"""KServe v2's JSON, as its HTTP/REST wire carries it (with Triton's binary tensor data
extension): an inference request's body read into the gRPC front end's ModelInfer
message (`read_infer`), its answer written back (`write_answer`), and the other
methods' protobuf answers written as Triton's HTTP server writes them
(`message_json`). No HTTP here: `kserve_http` serves it.

What the HTTP wire adds over gRPC's messages, read and written here: the JSON tensors
(`data`, nested or flat, row-major; BYTES as strings) and Triton's binary tensor data
(`binary_data_size` on an input, its bytes after the JSON header, whose length the
`Inference-Header-Content-Length` header gives; `binary_data` on an output, or
`binary_data_output` for all, answered the same way; BYTES in its raw encoding, each
element a 4-byte length and its bytes). Every input's bytes go to the
converter as raw contents, so a request may mix JSON and binary inputs, as Triton's HTTP
allows. Every fault of the JSON is an InvalidInputError naming it (never another
exception: each one was a 500).

JSON costs what it costs: a value is parsed into a Python object first (a float takes
~10 bytes of JSON and ~32 of memory while it is read; 10 MiB of FP32 values, 0.22 s to
read, 0.17 s of it Python's json.loads, measured once by hand): large tensors belong in
binary data.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from laneserve.client.tensors import MAX_DIMS, decode_strings, length_prefixed
from laneserve.kserve import grpc_predict_v2_pb2 as kpb
from laneserve.server.codec import among_first, given_more_than_once, too_many_inputs
from laneserve.server.engine import TensorSpec
from laneserve.server.errors import InvalidInputError
from laneserve.server.kserve_convert import (
    BYTES,
    KSERVE_DTYPES,
    ModelInferCall,
    check_integer_range,
)
from laneserve.server.shared_memory import REGION_PARAMETER

_T = TypeVar("_T")
# A protobuf field's descriptor (the pure-Python or the upb implementation's class).
_Field = Any

# Triton's binary tensor data extension: the JSON header's length, in bytes of the body.
HEADER_LENGTH: Final = "Inference-Header-Content-Length"
BINARY_TENSOR_EXTENSION: Final = "binary_tensor_data"  # ServerMetadata's name for it
BINARY_SIZE_PARAMETER: Final = "binary_data_size"  # an input's (and an answer output's)
BINARY_OUTPUT_PARAMETER: Final = "binary_data"  # a requested output's
ALL_BINARY_PARAMETER: Final = "binary_data_output"  # the request's: every output binary
# The most parameters a request, an input or an output may have (Triton's clients send a
# few): more are refused before they are walked.
_MAX_PARAMETERS: Final = 64

# A request's keys, an input's and an output's (KServe v2's $inference_request,
# $request_input, $request_output).
_REQUEST_KEYS: Final = ("id", "parameters", "inputs", "outputs")
_INPUT_KEYS: Final = ("name", "shape", "datatype", "parameters", "data")
_OUTPUT_KEYS: Final = ("name", "parameters")


def message_json(message: Message) -> dict[str, Any]:
    """`message` as Triton's HTTP server writes its protobuf answers (model config,
    statistics): proto field names, enums by name, 64-bit integers as JSON numbers (not
    strings, as protobuf's own JSON mapping writes them: perf_analyzer reads numbers),
    every scalar field written even at its default, as Triton's."""
    written: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and message.WhichOneof(oneof.name) != field.name:
            continue
        value = getattr(message, field.name)
        if _is_map(field):
            entry = _map_value(field)
            written[field.name] = {key: _field_value(entry, value[key]) for key in value}
        elif field.is_repeated:
            written[field.name] = [_field_value(field, item) for item in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not message.HasField(field.name):
            continue
        else:
            written[field.name] = _field_value(field, value)
    return written


def _is_map(field: _Field) -> bool:
    return bool(
        field.is_repeated
        and field.type == FieldDescriptor.TYPE_MESSAGE
        and field.message_type.GetOptions().map_entry
    )


def _map_value(field: _Field) -> _Field:
    return field.message_type.fields_by_name["value"]


def _field_value(field: _Field, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.full_name == kpb.InferParameter.DESCRIPTOR.full_name:
            kind = value.WhichOneof("parameter_choice")
            return None if kind is None else getattr(value, kind)
        return message_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        number = field.enum_type.values_by_number.get(value)
        return value if number is None else number.name
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


# ---- Inference ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class InferRead:
    """An HTTP inference request read into ModelInfer's message, with what its answer
    needs of the HTTP wire: which outputs go as binary data, which in shared memory."""

    call: ModelInferCall
    binary_outputs: Mapping[str, bool]  # by output name: its binary_data parameter
    all_binary: bool  # the request's binary_data_output
    # The outputs placed in shared memory, by name: read here, as the call's message is
    # let go of once converted.
    placed: frozenset[str]

    def binary(self, name: str) -> bool:
        return self.binary_outputs.get(name, self.all_binary)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a body's JSON is read: its lists and
    numbers are young objects by the million, and the collections they set off were
    ~80 % of reading one (13.0 s against 2.5 s for 64 MiB of nested lists, measured once
    by a reviewer). They hold no cycles: reference counting frees them once read. The
    collector is the process's: read on the event loop alone (a second thread's read
    could leave it off for good, each saving the other's "off")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@collector_paused()  # each call (its JSON's young objects by the million)
def read_infer(
    body: bytes,
    header_length: str | None,
    message: kpb.ModelInferRequest,
    *,
    input_specs: Sequence[TensorSpec],
    max_outputs: int,
) -> InferRead:
    """The body of POST .../infer read into `message` (which names the model and
    version) as ModelInfer's request: every input's data (JSON values converted to the
    datatype's bytes, or its binary data) in raw contents, in the order of its inputs,
    but for inputs placed in shared memory; the rest is ModelInfer's to check. Raises
    InvalidInputError naming the fault in the HTTP request itself (its JSON, its binary
    data's sizes), `message` filled as far as it was read (its parameters first)."""
    header, binary = _split(body, header_length)
    request = json_object(parse_json(header, _INFER_JSON), "the request", _REQUEST_KEYS)
    if "id" in request:
        message.id = typed(request["id"], str, "the request's 'id'", "a string")
    parameters = _parameters(request.get("parameters", {}), "the request")
    all_binary = parameters.pop(ALL_BINARY_PARAMETER, False)
    if not isinstance(all_binary, bool):
        raise InvalidInputError(
            f"request parameter {ALL_BINARY_PARAMETER!r} is {all_binary!r}; expected true or false"
        )
    _set_parameters(message.parameters, parameters)
    inputs = typed(request.get("inputs"), list, "the request's 'inputs'", "a list of inputs")
    outputs = typed(request.get("outputs", []), list, "the request's 'outputs'", "a list")
    binary_outputs: dict[str, bool] = {}
    # Refused on their counts before anything walks them: 16 million inputs of `{}` fit
    # 48 MiB, and adding each to the message took 10 s of the event loop. Too many inputs
    # named as ModelInfer names them, from the first of them only.
    if len(inputs) > len(input_specs):
        named = _named(inputs[: len(input_specs) + 1])
        if named is not None:
            raise too_many_inputs(named, input_specs, count=len(inputs))
    for items, most, kind in (
        (inputs, len(input_specs), "inputs"),
        (outputs, max_outputs, "outputs"),
    ):
        if len(items) > most:
            raise InvalidInputError(
                f"request has {len(items)} {kind}; {_given_twice(items, most)}expected at most "
                f"{most}, each of the model's {kind} at most once"
            )
    raw: list[bytes] = []
    offset = 0
    for position, item in enumerate(inputs):
        data, offset = _input(message, item, position, binary, offset)
        if data is not None:
            raw.append(data)
    if offset != len(binary):
        raise InvalidInputError(
            f"request has {len(binary)} bytes of binary data after its JSON header and its "
            f"inputs' {BINARY_SIZE_PARAMETER} claim {offset}; expected them to claim every byte"
        )
    placed: set[str] = set()
    for position, item in enumerate(outputs):
        name, wants_binary, in_shared_memory = _output(message, item, position)
        if wants_binary is not None:
            binary_outputs[name] = wants_binary
        if in_shared_memory:
            placed.add(name)
    # ModelInfer's converter reads each input's bytes from the call's raw contents and
    # only counts the message's: empty entries say how many, without a second copy.
    message.raw_input_contents.extend(b"" for _ in raw)
    call = ModelInferCall(message, tuple(raw), len(body))
    return InferRead(call, binary_outputs, all_binary, frozenset(placed))


@dataclasses.dataclass(frozen=True, slots=True)
class _JsonInput:
    """An input of the JSON, named (`codec.Named`)."""

    name: str


def _named(items: list[Any]) -> list[_JsonInput] | None:
    """`items` as named inputs, or None where one is no object with a string name (refused
    on its count, unnamed, then: its own fault is found where inputs are read)."""
    named = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str):
            return None
        named.append(_JsonInput(name))
    return named


def _given_twice(items: list[Any], most: int) -> str:
    """The names given more than once among the first `most` + 1 of more than `most`
    inputs (or outputs), in a refusal's words ("'x' is given more than once; "), as
    gRPC's refusal names them (`codec.extra_inputs`); "" where none is (a name the model
    lacks, which only the model's names would tell, or items that are no objects). The
    first `most` + 1 alone: the work stays bounded however many the request holds."""
    read = items[: most + 1]
    names = [item.get("name") for item in read if isinstance(item, dict)]
    counts = collections.Counter(name for name in names if isinstance(name, str))
    repeated = [name for name, count in counts.items() if count > 1]
    if not repeated:
        return ""
    return f"{among_first(len(read), len(items))}{given_more_than_once(repeated)}; "


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    digits = header_length.isascii() and header_length.isdigit()
    # Its digits counted before it is read, and only those read: int() refuses past 4 300
    # digits, leading zeros included (a 500).
    significant = header_length.lstrip("0") or "0"
    if not digits or len(significant) > len(str(len(body))) or int(significant) > len(body):
        raise InvalidInputError(
            f"header {HEADER_LENGTH} is {header_length!r}; expected the JSON header's length "
            f"in bytes, from 0 to the body's {len(body)}"
        )
    length = int(significant)
    view = memoryview(body)
    return bytes(view[:length]), view[length:]


class _InfinityLiteral(float):
    """An `Infinity` or `-Infinity` the JSON wrote: told from a number written past
    float64's range (`1e400`), which Python's parser reads as an infinity too."""


def _constant(name: str) -> float:
    """Python's reading of JSON's non-standard NaN, Infinity and -Infinity (what
    write_answer writes), an infinity marked as written so."""
    value = float(name)
    return _InfinityLiteral(value) if math.isinf(value) else value


class _RepeatedKeys(dict[str, Any]):
    """A JSON object that gives a key more than once (`_object`), kept as json.loads
    keeps it (the last value counts) for `typed` to refuse where laneserve reads it:
    there it is named (`what`). A proxy's reader may take the first value, and judge
    another request than the one laneserve runs."""

    __slots__ = ("repeated",)

    def __init__(self, pairs: list[tuple[str, Any]], repeated: str) -> None:
        super().__init__(pairs)
        self.repeated = repeated  # the first key given again


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The decoder's object_pairs_hook: `pairs` as json.loads makes them, marked where a
    key comes twice. Called per object, never per list element: each object costs
    ~0.12 us more than json.loads' own dicts (1 M of `{}`: 58 -> 174 ms), a request's
    few objects ~1 us, a `data` list of 1 M values nothing (~200 ms either way; measured
    once by hand)."""
    item = dict(pairs)
    if len(item) == len(pairs):
        return item
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return _RepeatedKeys(pairs, key)
        seen.add(key)
    raise AssertionError("unreachable: fewer keys than pairs, so one repeats")


_DECODER: Final = json.JSONDecoder(parse_constant=_constant, object_pairs_hook=_object)


def parse_json(header: bytes, expected: str) -> Any:
    """`header` parsed, or refused naming why and what was `expected`."""
    try:
        # json.loads(header) with a decoder made once: given parse_constant, json.loads
        # built a decoder per call (a small body's parse 2.6 -> 4.1 us).
        return _DECODER.decode(header.decode(json.detect_encoding(header), "surrogatepass"))
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError; an integer past
        # Python's 4 300 digits
        raise InvalidInputError(
            f"request's JSON does not parse ({error}); expected {expected}"
        ) from None
    except RecursionError:  # Python's parser recurses per nested list or object
        raise InvalidInputError(
            f"request's JSON nests lists or objects deeper than Python's parser goes; "
            f"expected {expected}"
        ) from None


_INFER_JSON: Final = (
    f"a KServe v2 inference request: {{'inputs': [...]}} (with binary data after it, its "
    f"length in the {HEADER_LENGTH} header)"
)


def typed(value: Any, kind: type[_T], what: str, expected: str) -> _T:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise InvalidInputError(f"{what} is {_json_kind(value)}; expected {expected}")
    if isinstance(value, str):
        _check_text(value, what)
    elif isinstance(value, _RepeatedKeys):
        raise InvalidInputError(
            f"{what} has key {value.repeated!r} more than once; expected each key once (JSON "
            "readers differ on which value counts)"
        )
    return value


def json_size(value: Any, what: str) -> int:
    """`value` as a byte count: an integer from 0 to 2**64 - 1 (a protobuf uint64)."""
    size = typed(value, int, what, "bytes, an integer >= 0")
    if not 0 <= size < 2**64:
        raise InvalidInputError(f"{what} is {size}; expected bytes, an integer >= 0")
    return size


def _check_text(text: str, what: str) -> None:
    """Refuses a JSON string protobuf cannot carry: a lone surrogate ("\\ud800" is valid
    JSON and no UTF-8), which raised UnicodeEncodeError as it was set (a 500)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise InvalidInputError(
            f"{what} holds a lone surrogate (an unpaired \\ud800-\\udfff escape); expected "
            "text that is valid UTF-8"
        ) from None


def _json_kind(value: Any) -> str:
    if value is None:
        return "missing (or null)"
    # isinstance, bool before int: the decoder's own dicts and floats are subclasses
    # (`_RepeatedKeys`, `_InfinityLiteral`).
    for kind, name in _KIND_NAMES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


_KIND_NAMES: Final = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "a list"),
    (dict, "an object"),
)


def json_object(value: Any, what: str, keys: Sequence[str]) -> dict[str, Any]:
    item = typed(value, dict, what, f"an object with keys {list(keys)}")
    unknown = sorted(key for key in item if key not in keys)
    if unknown:
        raise InvalidInputError(
            f"{what} has keys {unknown[:8]} laneserve does not read; expected some of {list(keys)}"
        )
    return item


def _parameters(value: Any, what: str) -> dict[str, Any]:
    parameters = typed(value, dict, f"{what}'s 'parameters'", "an object")
    if len(parameters) > _MAX_PARAMETERS:  # before any is walked (Triton sends a few)
        raise InvalidInputError(
            f"{what} has {len(parameters)} parameters; expected at most {_MAX_PARAMETERS}"
        )
    for key, item in parameters.items():
        _check_text(key, f"{what}'s parameter name")
        if isinstance(item, str):
            _check_text(item, f"{what}'s parameter {key!r}")
        if not isinstance(item, (bool, int, float, str)):
            raise InvalidInputError(
                f"{what}'s parameter {key!r} is {_json_kind(item)}; expected a boolean, "
                "an integer, a number or a string"
            )
    return dict(parameters)


def _set_parameters(into: Any, parameters: Mapping[str, Any]) -> None:
    """JSON parameters as InferParameters: the kind each value's JSON type maps to (a
    boolean a bool_param, an integer an int64_param, or a uint64_param past int64's
    range, a number a double_param, a string a string_param), which ModelInfer checks."""
    for key, value in parameters.items():
        parameter = into[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if -(2**63) <= value < 2**63:
                parameter.int64_param = value
            elif 0 <= value < 2**64:
                parameter.uint64_param = value
            else:
                raise InvalidInputError(
                    f"parameter {key!r} is {value}; expected an integer within 64 bits"
                )
        elif isinstance(value, float):
            parameter.double_param = value
        else:
            parameter.string_param = value


def _input(
    message: kpb.ModelInferRequest, value: Any, position: int, binary: memoryview, offset: int
) -> tuple[bytes | None, int]:
    """Adds input `value` to `message`; returns its bytes (None: in shared memory) and
    the offset of the next input's binary data."""
    item = json_object(value, f"input {position}", _INPUT_KEYS)
    name = typed(item.get("name"), str, f"input {position}'s 'name'", "a string")
    what = f"input {name!r}"
    datatype = typed(item.get("datatype"), str, f"{what}'s 'datatype'", "a string, e.g. 'FP32'")
    shape = _shape(item.get("shape"), what)
    parameters = _parameters(item.get("parameters", {}), what)
    size = parameters.pop(BINARY_SIZE_PARAMETER, None)
    tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
    _set_parameters(tensor.parameters, parameters)
    places = [
        where
        for where, given in (
            ("'data'", "data" in item),
            (f"parameter {BINARY_SIZE_PARAMETER!r}", size is not None),
            ("shared memory", REGION_PARAMETER in parameters),
        )
        if given
    ]
    if len(places) != 1:
        raise InvalidInputError(
            f"{what} has its data in {' and '.join(places) if places else 'none of them'}; "
            f"expected it in exactly one: 'data' (JSON values), parameter "
            f"{BINARY_SIZE_PARAMETER!r} (its bytes after the JSON header) or shared memory"
        )
    if REGION_PARAMETER in parameters:
        return None, offset
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInputError(
                f"{what} has {BINARY_SIZE_PARAMETER} {size!r}; expected its bytes, an integer >= 0"
            )
        if offset + size > len(binary):
            raise InvalidInputError(
                f"{what} has {BINARY_SIZE_PARAMETER} {size} from byte {offset} of the binary "
                f"data, which has {len(binary)}; expected each input's bytes within it, in "
                "the order of the inputs"
            )
        return bytes(binary[offset : offset + size]), offset + size
    return _json_values(what, datatype, shape, item["data"]), offset


def _shape(value: Any, what: str) -> list[int]:
    shape = typed(value, list, f"{what}'s 'shape'", "a list of integers")
    if len(shape) > MAX_DIMS:
        raise InvalidInputError(
            f"{what} has a shape of {len(shape)} dimensions; expected at most {MAX_DIMS}"
        )
    for index, dim in enumerate(shape):
        if type(dim) is not int or not -(2**63) <= dim < 2**63:
            raise InvalidInputError(
                f"{what} has {_shown(dim)} at index {index} of its 'shape'; expected an "
                "integer from -2**63 to 2**63 - 1 (a dimension, int64)"
            )
    return shape


def _shown(value: Any) -> str:
    """A JSON value in a refusal: its kind, and a scalar as JSON writes it (a string's
    first characters)."""
    if value is None:
        return "null"
    if type(value) is int:  # one past int64's range, of up to 4 300 digits
        digits = str(value)
        short = len(digits) <= _MAX_SHOWN_CHARACTERS
        return digits if short else f"an integer of {len(digits)} digits"
    if isinstance(value, (bool, float)):
        return f"{_json_kind(value)} ({json.dumps(value)})"
    if isinstance(value, str):
        return f"{_json_kind(value)} ({value[:_MAX_SHOWN_CHARACTERS]!r})"
    return _json_kind(value)


# The most characters of a value a refusal quotes (`_shown`).
_MAX_SHOWN_CHARACTERS: Final = 32


def _json_values(what: str, datatype: str, shape: Sequence[int], data: Any) -> bytes:
    """The input's JSON values (flat or nested, row-major) as its datatype's bytes,
    little-endian (BYTES: its raw encoding, `_json_strings`). A datatype laneserve does
    not serve, or a shape it refuses, is left to ModelInfer to refuse in its words (no
    bytes)."""
    dtype = KSERVE_DTYPES.get(datatype)
    if dtype is None or min(shape, default=0) < 0:
        return b""
    if not isinstance(data, list):
        raise InvalidInputError(f"{what}'s 'data' is {_json_kind(data)}; expected a list")
    if datatype == BYTES:
        return _json_strings(what, shape, data)
    try:
        values = np.array(data)
    except ValueError:  # lists of unequal lengths
        values = np.array([None])  # refused below, as not numbers
    # Integers past int64's range beside smaller ones are read as float64 (2**63 and 0)
    # or as objects: kept exact where every value is an integer (range checked below).
    exact = None
    if dtype.kind in "iu" and values.dtype.kind in "fO":
        exact = _exact_integers(data)
        values = values if exact is None else exact
    elif dtype.kind == "f" and values.dtype.kind == "O":
        # Integers past 64 bits among numbers (JavaScript writes 2**64 with its 20
        # digits, 18446744073709552000): numbers for a float type all the same.
        values = _wide_numbers(data, values)
    expected = math.prod(shape)
    wanted = {"b": "booleans (true, false)", "i": "integers", "u": "integers", "f": "numbers"}
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}[dtype.kind]
    numbers = not values.size or values.dtype.kind in kinds or exact is not None
    if numbers and values.size != expected:
        raise InvalidInputError(
            f"{what} has {values.size} values in 'data'; expected {expected} (shape {list(shape)})"
        )
    held = "" if numbers else _held(values, dtype, data)
    if numbers and dtype.kind != "b" and values.dtype.kind in "iuf" and _holds_a_boolean(data):
        # Which numpy read as 1 and 0.
        held = _first_fault(data, _LEAVES[dtype.kind]) or "booleans among numbers"
    if held:
        raise InvalidInputError(
            f"{what} is {datatype} and its 'data' holds {held}; expected a flat or nested "
            f"list of {wanted[dtype.kind]}"
        )
    if dtype.kind in "iu":
        check_integer_range(what, datatype, values, "")
    # An infinity not written as one (`1e400`, an integer of 400 digits) is a value past
    # float64's range, as 1e39 is past FP32's (the cast's overflow).
    beyond = dtype.kind == "f" and bool(np.isinf(values).any()) and _written_past_float64(data)
    if not beyond:
        try:
            with np.errstate(over="raise"):
                return values.astype(dtype, copy=False).tobytes()
        except FloatingPointError:
            pass
    largest = float(np.finfo(dtype).max)
    raise InvalidInputError(
        f"{what} is {datatype} and holds values beyond its range (+-{largest:.6g}); "
        f"expected finite {datatype} values, or Infinity written as such"
    )


def _json_strings(what: str, shape: Sequence[int], data: list[Any]) -> bytes:
    """A BYTES input's JSON strings, lists nested to any depth walked in order (as
    Triton's server reads them: their count is checked, not that the lists are
    rectangular), as BYTES's raw encoding (`length_prefixed`): each string's UTF-8
    given its length. Walked without recursion: the parser takes lists nested as deep as
    Python's recursion goes, and a recursive walk of those fails (a 500)."""
    expected = math.prod(shape)
    values: list[bytes] = []
    pending = [iter(data)]
    while pending:
        for item in pending[-1]:
            if type(item) is list:
                pending.append(iter(item))
                break
            if type(item) is not str:
                held = "null" if item is None else _json_kind(item)
                raise InvalidInputError(
                    f"{what} is {BYTES} and its 'data' holds {held} (element {len(values)}); "
                    "expected a flat or nested list of strings"
                )
            if len(values) == expected:  # one more than the shape holds: not walked on
                raise InvalidInputError(
                    f"{what} has more than {expected} values in 'data'; expected {expected} "
                    f"(shape {list(shape)})"
                )
            try:
                values.append(item.encode())  # encoded once: checked as it is
            except UnicodeEncodeError:
                _check_text(item, f"{what}, element {len(values)} of 'data',")  # raises
                raise  # unreachable: an item that does not encode is refused above
        else:
            pending.pop()
    if len(values) != expected:
        raise InvalidInputError(
            f"{what} has {len(values)} values in 'data'; expected {expected} (shape {list(shape)})"
        )
    return length_prefixed(values)


def _wide_numbers(data: list[Any], values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """`data` as float64 where it holds numbers alone, integers past 64 bits among them,
    in rectangular lists (one past float64's range an infinity: refused as such);
    `values` as it was otherwise (refused as not numbers)."""
    exact = _python_values(data, _NUMBER_TYPES)
    if exact is None:
        return values
    floats = np.fromiter((_float(value) for value in exact.flat), np.float64, exact.size)
    return floats.reshape(exact.shape)


_NUMBER_TYPES: Final = (int, float, _InfinityLiteral)


def _float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float64's range
        return math.inf if value > 0 else -math.inf


def _written_past_float64(data: list[Any]) -> bool:
    """Whether nested lists `data` hold a number written past float64's range: an
    infinity not written Infinity, or an integer beyond float64's largest. Walked only
    where an infinity was read."""
    largest = sys.float_info.max  # a Python float: compared with an int exactly
    pending = [data]
    while pending:
        for item in pending.pop():
            if type(item) is list:
                pending.append(item)
            elif (type(item) is float and math.isinf(item)) or (
                type(item) is int and abs(item) > largest
            ):
                return True
    return False


def _exact_integers(data: list[Any]) -> np.ndarray[Any, Any] | None:
    """`data` as an object array of its Python integers, None unless it holds integers
    alone, in rectangular lists (true and false are no integers here)."""
    return _python_values(data, (int,))


def _python_values(data: list[Any], types: tuple[type, ...]) -> np.ndarray[Any, Any] | None:
    """`data` as an object array of its Python values, None unless each value's type is
    one of `types` exactly (bool is no int here) and the lists are rectangular."""
    try:
        exact = np.array(data, dtype=object)
        if exact.size and all(type(value) in types for value in exact.flat):
            return exact
    # Lists of unequal lengths; nested past what numpy walks (`flat` takes 32 dimensions).
    except (ValueError, RuntimeError):
        pass
    return None


def _holds_a_boolean(data: list[Any]) -> bool:
    """Whether nested lists `data` hold true or false anywhere: numpy reads one among
    numbers as 1 or 0 (one pass over the values, ~30 ns each, against ~1 us each to
    parse them)."""
    pending = [data]
    while pending:
        for item in pending.pop():
            if item is True or item is False:
                return True
            if type(item) is list:
                pending.append(item)
    return False


def _held(values: np.ndarray[Any, Any], dtype: np.dtype[Any], data: list[Any]) -> str:
    """What `values` (`data` as numpy read it), refused for `dtype`, hold, in a
    refusal's words."""
    kind = values.dtype.kind
    if kind == "f":
        return _floats_held(values)
    if kind in "biu":
        return "booleans" if kind == "b" else "integers"
    fault = _first_fault(data, _LEAVES[dtype.kind])
    if fault:
        return fault
    # For a float type integers of any length were read (`_wide_numbers`).
    wide = "" if dtype.kind == "f" else " (or not within 64 bits)"
    return f"values that are not numbers{wide}, or lists of unequal lengths"


# The JSON values each kind of dtype takes, by their exact type (bool is no int here).
_LEAVES: Final[Mapping[str, tuple[type, ...]]] = {
    "b": (bool,),
    "i": (int,),
    "u": (int,),
    "f": _NUMBER_TYPES,
}


def _first_fault(data: list[Any], leaves: tuple[type, ...]) -> str:
    """Where nested lists `data` first (in row-major order) hold a value whose type is
    not one of `leaves`, or stop being rectangular, in a refusal's words ("null (element
    3)", "lists of unequal lengths: data[1] has 2 values, data[0] has 3"); "" where they
    are neither. Walked on a refusal's path alone, without recursion (the parser takes
    lists nested as deep as Python's recursion goes)."""
    lengths = [len(data)]  # by depth: the length of the first list at that depth
    value_depth: int | None = None  # the depth of the first value
    element = 0
    walking: list[tuple[list[Any], int]] = [(data, 0)]  # each list, and its next index
    while walking:
        items, at = walking[-1]
        if at == len(items):
            walking.pop()
            continue
        walking[-1] = (items, at + 1)
        item, depth = items[at], len(walking)  # data's own items are at depth 1
        if type(item) is list:
            if depth < len(lengths) and len(item) != lengths[depth]:
                return (
                    f"lists of unequal lengths: {_path(walking)} has {_values(len(item))}, "
                    f"{_first_path(depth)} has {lengths[depth]}"
                )
            if value_depth is not None and depth >= value_depth:
                return f"a list at {_path(walking)}, where {_first_path(value_depth)} is a value"
            if depth == len(lengths):
                lengths.append(len(item))
            walking.append((item, 0))
            continue
        if depth < len(lengths):
            return f"a value at {_path(walking)}, where {_first_path(depth)} is a list"
        value_depth = depth
        if type(item) not in leaves:
            return f"{'null' if item is None else _json_kind(item)} (element {element})"
        element += 1
    return ""


def _path(walking: list[tuple[list[Any], int]]) -> str:
    """The item `_first_fault` walks now, as an index into 'data' ("data[1][0]")."""
    return "data" + "".join(f"[{at - 1}]" for _, at in walking)


def _first_path(depth: int) -> str:
    return "data" + "[0]" * depth


def _values(count: int) -> str:
    return "1 value" if count == 1 else f"{count} values"


def _floats_held(values: np.ndarray[Any, Any]) -> str:
    """What float `values`, refused for an integer type, hold."""
    if not np.isfinite(values).all():
        return "NaN or infinities"
    if (values == np.trunc(values)).all():
        return "numbers written as floats (1e3, 2.0)"
    return "numbers with fractions"


def _output(
    message: kpb.ModelInferRequest, value: Any, position: int
) -> tuple[str, bool | None, bool]:
    """Adds requested output `value` to `message`; returns its name, its binary_data
    parameter (None: not given) and whether it is placed in shared memory."""
    item = json_object(value, f"output {position}", _OUTPUT_KEYS)
    name = typed(item.get("name"), str, f"output {position}'s 'name'", "a string")
    parameters = _parameters(item.get("parameters", {}), f"output {name!r}")
    wants_binary = parameters.pop(BINARY_OUTPUT_PARAMETER, None)
    if wants_binary is not None and not isinstance(wants_binary, bool):
        raise InvalidInputError(
            f"output {name!r} has {BINARY_OUTPUT_PARAMETER} {wants_binary!r}; expected true "
            "or false"
        )
    tensor = message.outputs.add(name=name)
    _set_parameters(tensor.parameters, parameters)
    return name, wants_binary, REGION_PARAMETER in parameters


# ---- Inference: the answer -----------------------------------------------------------------


def write_answer(response: kpb.ModelInferResponse, read: InferRead) -> tuple[bytes, int | None]:
    """ModelInfer's answer as KServe v2's JSON: each output's values in `data` (flat,
    row-major; a BYTES output's elements as strings), or as binary data after the JSON
    where asked (its size in its `binary_data_size`; BYTES's raw encoding, each element
    length-prefixed), or, placed in shared memory, neither (its name, datatype and
    shape say what was written there). Returns the body and, where binary data follows
    the JSON, the JSON's length (HEADER_LENGTH's value); None: the body is JSON alone.
    A NaN or an infinity among the values is written NaN, Infinity or -Infinity, as
    Python's and tritonclient's parsers read them (strict JSON has no such number: a
    caller whose outputs may hold them asks for binary data)."""
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for output, data in zip(response.outputs, response.raw_output_contents, strict=True):
        entry: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if output.name in read.placed:
            pass
        elif read.binary(output.name):
            entry["parameters"] = {BINARY_SIZE_PARAMETER: len(data)}
            chunks.append(data)
        elif output.datatype == BYTES:  # JSON strings, as Triton's server writes them
            count = math.prod(output.shape)
            entry["data"] = decode_strings(f"output {output.name!r}", data, count).tolist()
        else:
            entry["data"] = np.frombuffer(data, KSERVE_DTYPES[output.datatype]).tolist()
        outputs.append(entry)
    answer: dict[str, Any] = {"model_name": response.model_name}
    answer["model_version"] = response.model_version
    if response.id:
        answer["id"] = response.id
    answer["parameters"] = {
        key: _field_value(_PARAMETER_FIELD, value) for key, value in response.parameters.items()
    }
    answer["outputs"] = outputs
    header = json.dumps(answer).encode()
    if not chunks:
        return header, None
    return b"".join((header, *chunks)), len(header)


_PARAMETER_FIELD: Final = _map_value(kpb.ModelInferResponse.DESCRIPTOR.fields_by_name["parameters"])
