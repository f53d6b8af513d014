"""laneserve.v1 only ever grows: inference.proto against its committed baseline.

The header of inference.proto promises that fields are only ever added, never renumbered
or reused. tests/data/inference_v1_baseline.json records the contract as it was last
fixed: per message its fields (number, type, label, presence, oneof, JSON name) and
reservations, per enum its values, per service its methods, and the file's package and
language options. Two tests hold the current descriptor (the generated
laneserve.v1.inference_pb2, which test_generated_code keeps in step with the .proto) to it:

- `test_the_contract_keeps_everything_in_the_baseline`: every message, field, enum value,
  reservation and method of the baseline is still there, alike, or (fields and enum
  values) removed with its number and name `reserved`. Additions pass.
- `test_the_baseline_covers_the_current_contract`: nothing is in the descriptor that the
  baseline lacks, so a new field enters the baseline deliberately, and its number is
  fixed from then on. Refresh it, from the repository root, with::

      .venv/bin/python -m tests.test_proto_compat --write-baseline

  which refuses to write while the first test would fail: a breaking change cannot be
  made to pass by refreshing the baseline.

The rest check the checker, on descriptors changed in memory (a pool builds each, so it
is a valid .proto): a renumbered or retyped field fails, a removed one passes once
reserved, an added one passes the first test and fails the second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from google.rpc import status_pb2

from laneserve.v1 import inference_pb2

BASELINE = Path(__file__).resolve().parent / "data" / "inference_v1_baseline.json"
WRITE_COMMAND = ".venv/bin/python -m tests.test_proto_compat --write-baseline"

# The file options other languages' generated code depends on: changed, their import
# paths and namespaces change (buf's FILE_SAME_* rules).
FILE_OPTIONS = ("csharp_namespace", "go_package", "java_multiple_files", "java_package")

# A described contract, as the baseline file holds it (JSON).
Contract = dict[str, Any]

_FIELD = descriptor_pb2.FieldDescriptorProto


def describe(file: descriptor_pb2.FileDescriptorProto) -> Contract:
    """What of `file` the wire, JSON and generated code depend on, as JSON-ready data.
    Reserved ranges are half-open [start, end) for messages and enums alike (an enum's
    are inclusive in the descriptor)."""
    messages: dict[str, Any] = {}
    enums: dict[str, Any] = {}
    for name, message in _messages(file.package, file.message_type):
        messages[name] = _message(message)
        enums.update(_enums(name, message.enum_type))
    enums.update(_enums(file.package, file.enum_type))
    options = dict(
        sorted(
            (option.name, value)
            for option, value in file.options.ListFields()
            if option.name in FILE_OPTIONS
        )
    )
    return {
        "_about": (
            f"The fixed contract of {file.name}; tests/test_proto_compat.py checks the "
            f"descriptor against it. Regenerate with `{WRITE_COMMAND}`."
        ),
        "file": file.name,
        "package": file.package,
        "options": options,
        "messages": dict(sorted(messages.items())),
        "enums": dict(sorted(enums.items())),
        "services": {
            f"{file.package}.{service.name}": {
                method.name: {
                    "input_type": method.input_type,
                    "output_type": method.output_type,
                    "client_streaming": method.client_streaming,
                    "server_streaming": method.server_streaming,
                }
                for method in service.method
            }
            for service in file.service
        },
    }


def _messages(
    scope: str, messages: Sequence[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    """Every message by full name, nested ones (map entries included) after their parent."""
    for message in messages:
        name = f"{scope}.{message.name}"
        yield name, message
        yield from _messages(name, message.nested_type)


def _message(message: descriptor_pb2.DescriptorProto) -> dict[str, Any]:
    fields = {}
    for field in sorted(message.field, key=lambda field: field.number):
        # A proto3 `optional` field sits in a synthetic oneof of its own: that is its
        # presence (proto3_optional), not a oneof of the contract.
        in_oneof = field.HasField("oneof_index") and not field.proto3_optional
        fields[field.name] = {
            "number": field.number,
            "type": _FIELD.Type.Name(field.type).removeprefix("TYPE_").lower(),
            "type_name": field.type_name,
            "label": _FIELD.Label.Name(field.label).removeprefix("LABEL_").lower(),
            "proto3_optional": field.proto3_optional,
            "oneof": message.oneof_decl[field.oneof_index].name if in_oneof else "",
            "json_name": _json_name(field),
        }
    return {
        "fields": fields,
        "reserved_ranges": [[span.start, span.end] for span in message.reserved_range],
        "reserved_names": sorted(message.reserved_name),
    }


def _enums(
    scope: str, enums: Sequence[descriptor_pb2.EnumDescriptorProto]
) -> dict[str, dict[str, Any]]:
    return {
        f"{scope}.{enum.name}": {
            "values": {
                value.name: value.number
                for value in sorted(enum.value, key=lambda value: value.number)
            },
            "reserved_ranges": [[span.start, span.end + 1] for span in enum.reserved_range],
            "reserved_names": sorted(enum.reserved_name),
        }
        for enum in enums
    }


def _json_name(field: descriptor_pb2.FieldDescriptorProto) -> str:
    """The field's JSON name: its `json_name` option, else protoc's default (lowerCamelCase,
    each underscore dropped and the letter after it capitalised)."""
    if field.HasField("json_name"):
        return field.json_name
    parts = field.name.split("_")
    return parts[0] + "".join(part[:1].upper() + part[1:] for part in parts[1:])


def breaking_changes(baseline: Contract, current: Contract) -> list[str]:
    """How `current` breaks `baseline`'s clients (empty: it does not). Additions are
    never breaking; a field or enum value may go only with its number and name reserved."""
    problems = [
        f"{key} was {baseline[key]!r}, is {current[key]!r}"
        for key in ("file", "package")
        if baseline[key] != current[key]
    ]
    problems += [
        f"file option {option} was {value!r}, is {current['options'].get(option)!r}"
        for option, value in baseline["options"].items()
        if current["options"].get(option) != value
    ]
    for name, message in baseline["messages"].items():
        now = current["messages"].get(name)
        if now is None:
            problems.append(f"message {name} was removed")
        else:
            problems += _field_changes(name, message, now)
    for name, enum in baseline["enums"].items():
        now = current["enums"].get(name)
        if now is None:
            problems.append(f"enum {name} was removed")
        else:
            problems += _value_changes(name, enum, now)
    for name, methods in baseline["services"].items():
        now_methods = current["services"].get(name)
        if now_methods is None:
            problems.append(f"service {name} was removed")
            continue
        for method, shape in methods.items():
            now_shape = now_methods.get(method)
            if now_shape is None:
                problems.append(f"method {name}.{method} was removed")
            elif now_shape != shape:
                problems.append(f"method {name}.{method} was {shape}, is {now_shape}")
    return problems


def _field_changes(name: str, message: dict[str, Any], now: dict[str, Any]) -> list[str]:
    problems = []
    by_number = {field["number"]: field_name for field_name, field in now["fields"].items()}
    for field_name, field in message["fields"].items():
        where = f"field {name}.{field_name} ({field['number']})"
        now_field = now["fields"].get(field_name)
        if now_field is None:
            taken_by = by_number.get(field["number"])
            if taken_by is not None:
                problems.append(f"{where} was renamed or its number reused: now {taken_by!r}")
            elif not _reserved(field["number"], field_name, now):
                problems.append(
                    f"{where} was removed without `reserved {field['number']}; reserved "
                    f'"{field_name}";` in {name} (its number and name may never be reused)'
                )
            continue
        problems += [
            f"{where}: {key} was {field[key]!r}, is {now_field[key]!r}"
            for key in field
            if now_field[key] != field[key]
        ]
    problems += _reservation_changes(f"message {name}", message, now)
    return problems


def _value_changes(name: str, enum: dict[str, Any], now: dict[str, Any]) -> list[str]:
    problems = []
    by_number = {number: value_name for value_name, number in now["values"].items()}
    for value_name, number in enum["values"].items():
        where = f"enum value {name}.{value_name} ({number})"
        now_number = now["values"].get(value_name)
        if now_number is None:
            taken_by = by_number.get(number)
            if taken_by is not None:
                problems.append(f"{where} was renamed or its number reused: now {taken_by!r}")
            elif not _reserved(number, value_name, now):
                problems.append(
                    f"{where} was removed without `reserved {number}; reserved "
                    f'"{value_name}";` in {name} (its number and name may never be reused)'
                )
        elif now_number != number:
            problems.append(f"{where} was renumbered to {now_number}")
    problems += _reservation_changes(f"enum {name}", enum, now)
    return problems


def _reservation_changes(where: str, before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """A reservation, once made, stays: it is what keeps a removed number from reuse."""
    problems = [
        f"{where}: reserved {start} to {end - 1} is no longer reserved"
        for start, end in before["reserved_ranges"]
        if not all(_in_ranges(number, now["reserved_ranges"]) for number in range(start, end))
    ]
    problems += [
        f'{where}: reserved "{reserved}" is no longer reserved'
        for reserved in before["reserved_names"]
        if reserved not in now["reserved_names"]
    ]
    return problems


def _reserved(number: int, name: str, now: dict[str, Any]) -> bool:
    return _in_ranges(number, now["reserved_ranges"]) and name in now["reserved_names"]


def _in_ranges(number: int, ranges: list[list[int]]) -> bool:
    return any(start <= number < end for start, end in ranges)


def uncovered(baseline: Contract, current: Contract) -> list[str]:
    """What differs between `current` and `baseline`, as lines: `+ ` in the descriptor
    only (an addition not yet in the baseline), `- ` in the baseline only."""
    before, now = set(_lines(baseline)), set(_lines(current))
    return [f"- {line}" for line in sorted(before - now)] + [
        f"+ {line}" for line in sorted(now - before)
    ]


def _lines(contract: Contract) -> Iterator[str]:
    """`contract` as one line per leaf: a field, an enum value, a method, an option."""
    for section, entries in contract.items():
        if section == "_about":
            continue
        if not isinstance(entries, dict):
            yield f"{section} = {json.dumps(entries)}"
            continue
        for name, entry in entries.items():
            if section == "options":
                yield f"option {name} = {json.dumps(entry)}"
            elif section == "services":
                for method, shape in entry.items():
                    yield f"rpc {name}.{method} {json.dumps(shape, sort_keys=True)}"
            else:
                for part, items in entry.items():
                    if isinstance(items, dict):
                        for key, value in items.items():
                            yield f"{name}.{key} {json.dumps(value, sort_keys=True)}"
                    else:
                        yield f"{name} {part} {json.dumps(items)}"


def current_contract() -> Contract:
    return describe(_file_proto(inference_pb2.DESCRIPTOR))


def _file_proto(file: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    return proto


def load_baseline(path: Path = BASELINE) -> Contract:
    loaded: Contract = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def format_contract(contract: Contract) -> str:
    """The baseline's text: JSON with one line per field, enum value and method, so that
    a diff of it reads as the contract's change."""
    return _format(contract, ()) + "\n"


def _format(value: Any, path: tuple[str, ...]) -> str:
    # A field (messages.<message>.fields.<field>) or a method (services.<service>.<method>)
    # on one line, as is every list and scalar.
    one_line = (path[:1] == ("messages",) and path[2:3] == ("fields",) and len(path) == 4) or (
        path[:1] == ("services",) and len(path) == 3
    )
    if one_line or not isinstance(value, dict) or not value:
        return json.dumps(value)
    indent = "  " * len(path)
    items = [
        f"{indent}  {json.dumps(key)}: {_format(item, (*path, key))}" for key, item in value.items()
    ]
    return "{\n" + ",\n".join(items) + f"\n{indent}}}"


def write_baseline(current: Contract, path: Path = BASELINE) -> list[str]:
    """Writes `current` as the baseline at `path`, unless it breaks the baseline there:
    then writes nothing and returns why."""
    if path.exists():
        problems = breaking_changes(load_baseline(path), current)
        if problems:
            return problems
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_contract(current), encoding="utf-8")
    return []


def _refusal(problems: list[str]) -> str:
    return "\n  ".join(
        [
            (
                "inference.proto breaks laneserve.v1 (fields are only ever added, never "
                "renumbered, retyped or reused; remove one only with its number and name "
                "`reserved`):"
            ),
            *problems,
        ]
    )


# ---- the contract --------------------------------------------------------------------


def test_the_contract_keeps_everything_in_the_baseline() -> None:
    problems = breaking_changes(load_baseline(), current_contract())
    assert not problems, _refusal(problems)


def test_the_baseline_covers_the_current_contract() -> None:
    differences = uncovered(load_baseline(), current_contract())
    assert not differences, "\n  ".join(
        [
            (
                f"inference.proto differs from {BASELINE.relative_to(BASELINE.parents[2])} "
                "(+ only in the descriptor, - only in the baseline):"
            ),
            *differences,
            (
                "Where test_the_contract_keeps_everything_in_the_baseline passes, these are "
                "additions: fix them in the baseline (after scripts/gen_protos) with"
            ),
            f"  {WRITE_COMMAND}",
            "and commit it with the .proto.",
        ]
    )


def test_the_committed_baseline_is_as_the_writer_writes_it() -> None:
    """So that the file is only ever changed by the writer, and its diffs stay readable."""
    text = BASELINE.read_text(encoding="utf-8")
    assert text == format_contract(json.loads(text))


def test_the_contract_carries_the_language_options() -> None:
    """protoc-gen-go refuses a file without go_package (or an M mapping per file)."""
    assert current_contract()["options"] == {
        "csharp_namespace": "Laneserve.V1",
        "go_package": "laneserve.dev/gen/go/laneserve/v1;laneservev1",
        "java_multiple_files": True,
        "java_package": "dev.laneserve.v1",
    }


# ---- the checker, on descriptors changed in memory -----------------------------------


def _built(file: descriptor_pb2.FileDescriptorProto) -> Contract:
    """`file` built in a pool of its own (so that it is a valid .proto: protoc's checks,
    a reserved number in use included), described."""
    pool = descriptor_pool.DescriptorPool()
    for dependency in (any_pb2.DESCRIPTOR, status_pb2.DESCRIPTOR):
        pool.Add(_file_proto(dependency))
    pool.Add(file)
    return describe(_file_proto(pool.FindFileByName(file.name)))


def _changed(change: Callable[[descriptor_pb2.FileDescriptorProto], object]) -> Contract:
    file = _file_proto(inference_pb2.DESCRIPTOR)
    change(file)
    return _built(file)


def _message_proto(
    file: descriptor_pb2.FileDescriptorProto, name: str
) -> descriptor_pb2.DescriptorProto:
    [message] = [message for message in file.message_type if message.name == name]
    return message


def _field_proto(
    file: descriptor_pb2.FileDescriptorProto, message: str, name: str
) -> descriptor_pb2.FieldDescriptorProto:
    [field] = [field for field in _message_proto(file, message).field if field.name == name]
    return field


def _renumber_lane(file: descriptor_pb2.FileDescriptorProto) -> None:
    _field_proto(file, "InferRequest", "lane").number = 6


def _retype_queue_us(file: descriptor_pb2.FileDescriptorProto) -> None:
    _field_proto(file, "Timing", "queue_us").type = _FIELD.TYPE_UINT32


def _unrepeat_output_names(file: descriptor_pb2.FileDescriptorProto) -> None:
    _field_proto(file, "InferRequest", "output_names").label = _FIELD.LABEL_OPTIONAL


def _rename_lane(file: descriptor_pb2.FileDescriptorProto) -> None:
    _field_proto(file, "InferRequest", "lane").name = "lane_name"


def _drop_infer_us(file: descriptor_pb2.FileDescriptorProto) -> None:
    timing = _message_proto(file, "Timing")
    timing.field.remove(_field_proto(file, "Timing", "infer_us"))


def _renumber_float16(file: descriptor_pb2.FileDescriptorProto) -> None:
    [data_type] = file.enum_type
    [value] = [value for value in data_type.value if value.name == "DATA_TYPE_FLOAT16"]
    value.number = 13


def _stream_get_stats(file: descriptor_pb2.FileDescriptorProto) -> None:
    [service] = file.service
    [method] = [method for method in service.method if method.name == "GetStats"]
    method.server_streaming = True


def _move_go_package(file: descriptor_pb2.FileDescriptorProto) -> None:
    file.options.go_package = "example.com/laneserve/v1;laneservev1"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_renumber_lane, "field laneserve.v1.InferRequest.lane (2): number was 2, is 6"),
        (_retype_queue_us, "field laneserve.v1.Timing.queue_us (3): type was 'uint64'"),
        (_unrepeat_output_names, "InferRequest.output_names (5): label was 'repeated'"),
        (_rename_lane, "InferRequest.lane (2) was renamed or its number reused"),
        (_drop_infer_us, 'Timing.infer_us (4) was removed without `reserved 4; reserved "'),
        (_renumber_float16, "DataType.DATA_TYPE_FLOAT16 (2) was renumbered to 13"),
        (_stream_get_stats, "method laneserve.v1.InferenceService.GetStats was"),
        (_move_go_package, "file option go_package was"),
    ],
)
def test_a_breaking_change_is_named(
    change: Callable[[descriptor_pb2.FileDescriptorProto], object], problem: str
) -> None:
    problems = breaking_changes(current_contract(), _changed(change))

    assert len(problems) == 1, problems
    assert problem in problems[0]


def test_a_field_removed_with_its_number_and_name_reserved_is_no_break() -> None:
    def reserve_infer_us(file: descriptor_pb2.FileDescriptorProto) -> None:
        _drop_infer_us(file)
        timing = _message_proto(file, "Timing")
        timing.reserved_range.add(start=4, end=5)
        timing.reserved_name.append("infer_us")

    def reserve_number_only(file: descriptor_pb2.FileDescriptorProto) -> None:
        _drop_infer_us(file)
        _message_proto(file, "Timing").reserved_range.add(start=4, end=5)

    reserved = _changed(reserve_infer_us)

    assert breaking_changes(current_contract(), reserved) == []
    assert breaking_changes(current_contract(), _changed(reserve_number_only)) != []
    # Once in the baseline, the reservation itself is part of the contract.
    assert breaking_changes(reserved, current_contract()) == [
        "message laneserve.v1.Timing: reserved 4 to 4 is no longer reserved",
        'message laneserve.v1.Timing: reserved "infer_us" is no longer reserved',
    ]


def test_an_added_field_passes_the_contract_and_must_enter_the_baseline() -> None:
    def add_priority_hint(file: descriptor_pb2.FileDescriptorProto) -> None:
        _message_proto(file, "InferRequest").field.add(
            name="priority_hint", number=6, type=_FIELD.TYPE_UINT32, label=_FIELD.LABEL_OPTIONAL
        )

    grown = _changed(add_priority_hint)

    assert breaking_changes(current_contract(), grown) == []
    assert uncovered(current_contract(), grown) == [
        (
            "+ laneserve.v1.InferRequest.priority_hint "
            '{"json_name": "priorityHint", "label": "optional", "number": 6, "oneof": "", '
            '"proto3_optional": false, "type": "uint32", "type_name": ""}'
        )
    ]


def test_the_writer_refuses_a_breaking_change(tmp_path: Path) -> None:
    path = tmp_path / "data" / "baseline.json"
    assert write_baseline(current_contract(), path) == []
    written = path.read_text(encoding="utf-8")

    problems = write_baseline(_changed(_renumber_lane), path)

    assert problems == [
        "field laneserve.v1.InferRequest.lane (2): number was 2, is 6",
    ]
    assert path.read_text(encoding="utf-8") == written
    assert load_baseline(path) == current_contract()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.test_proto_compat",
        description=f"Fixes the current laneserve.v1 contract in {BASELINE.name}.",
    )
    parser.add_argument(
        "--write-baseline",
        action="store_true",
        required=True,
        help="write the baseline from laneserve.v1.inference_pb2 (run scripts/gen_protos "
        "first); refused while the change breaks the committed baseline",
    )
    parser.parse_args(argv)
    current = current_contract()
    if BASELINE.exists() and load_baseline() == current:
        print(f"{BASELINE}: up to date", file=sys.stderr)
        return 0
    problems = write_baseline(current)
    if problems:
        print(_refusal(problems), file=sys.stderr)
        print(f"{BASELINE}: not written", file=sys.stderr)
        return 1
    print(f"{BASELINE}: written; commit it with inference.proto", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
