"""`laneserve-client`: call a laneserve server from the shell.

    laneserve-client model                                   the model (sha256, version), lanes
    laneserve-client stats                                   live counters as a table
    laneserve-client infer --json '{"input": [[0.1, ...]]}'  one request, outputs as JSON
    laneserve-client bulk --input rows.npy --output out.npy  a bulk job with a checkpoint

The connection options (``--target HOST:PORT``, default 127.0.0.1:50051; the TLS
options; --metadata, --attempts, --timeout, --log-level) go before the subcommand or
after it; one given in both places is taken from after it, but for --metadata, whose
pairs from both are sent. A string input is given as JSON strings, or as a numpy str_
(or bytes_) array in .npy / .npz; a string output is printed as JSON strings, and
written as a str_ array as wide as its widest element. Exit codes: 0 everything done;
1 some rows failed (bulk: the output written with them as NaN, "" in a string output,
listed in OUTPUT.failed.json; rerun with --resume to retry them); 2 bad
usage or input (infer and bulk: checked against the server's model and lanes before
anything is sent), refused by this client or by the server
(INVALID_INPUT); 3 the server could not be reached, or refused the call for its own
reasons (a full lane, a drain, its limits; bulk: the checkpoint is saved, --resume goes
on); 130 / 143 interrupted by SIGINT / SIGTERM (bulk: the checkpoint is saved, --resume
goes on); 141 standard output closed early (a pipe into `head`),
as a shell reports a command that SIGPIPE ended.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import json
import logging
import math
import os
import signal
import sys
import time
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final, TextIO

import numpy as np
import numpy.typing as npt

from laneserve.client._aio import MAX_TIMEOUT_S
from laneserve.client._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    TlsConfig,
    check_pem_files,
    check_target,
    metadata_pair,
)
from laneserve.client._checkpoint import (
    Checkpoint,
    CheckpointError,
    locked,
    replace_file,
    same_file,
    text_array,
    write_npz,
)
from laneserve.client._errors import InvalidInputError, LaneserveError
from laneserve.client._request import encode_inputs, infer_request
from laneserve.client._retry import RetryPolicy
from laneserve.client._stream import DEFAULT_STREAM_LANE, SERVER_STREAM_LANE
from laneserve.client._sync import Client
from laneserve.client._types import ModelInfo, StreamRequest, TensorInfo
from laneserve.client.tensors import datatype_name, is_text_dtype, named_dimension_conflict
from laneserve.v1 import inference_pb2 as pb

EXIT_OK: Final = 0
EXIT_FAILED_ROWS: Final = 1
EXIT_USAGE: Final = 2
EXIT_SERVER: Final = 3
EXIT_SIGINT: Final = 130
EXIT_SIGTERM: Final = 143
EXIT_BROKEN_PIPE: Final = 141  # 128 + SIGPIPE
# Failed items quoted in a bulk job's summary.
_EXAMPLES: Final = 3
# How each file numpy writes starts (np.load's own test; an empty zip archive starts with
# its end record), and what writes it. np.load takes any other file for a pickle, and its
# advice, to pass allow_pickle=, would run code from a file that is not an array at all.
_MAGIC: Final[dict[str, tuple[tuple[bytes, ...], str]]] = {
    ".npy": ((np.lib.format.MAGIC_PREFIX,), "an array written by numpy.save"),
    ".npz": ((b"PK\x03\x04", b"PK\x05\x06"), "arrays written by numpy.savez (a zip archive)"),
}

# What zipfile raises, beyond OSError and ValueError, for an archive it cannot read: one
# cut short or otherwise damaged (BadZipFile: no end record, a bad CRC), a compressed member
# whose data is damaged (zlib.error) or cut short (EOFError), a compression method it lacks
# (NotImplementedError), an encrypted member (RuntimeError).
_DAMAGED_ARCHIVE: Final = (
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    NotImplementedError,
    RuntimeError,
)

Arrays = dict[str, npt.NDArray[Any]]
Handler = Callable[[Client, argparse.Namespace], int]
# The wire's name for text ("string"), which a message gives for an object array.
_STRING: Final = datatype_name(pb.DATA_TYPE_STRING)


class UsageError(Exception):
    """Bad arguments or input files: exit 2 with the message."""


class Terminated(Exception):  # noqa: N818 - named after the signal, like KeyboardInterrupt
    """SIGTERM arrived; handled like Ctrl-C."""


def main(argv: Sequence[str] | None = None) -> int:
    """The console script's entry point (it calls this directly: anything `python -m`
    alone would handle must be handled here)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, where a closed pipe is only reported
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Python flushes stdout once more
        # at exit; pointed at devnull, that flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with _stopped_once(), _client(args) as client:
            handler: Handler = args.handler
            return handler(client, args)
    except UsageError as error:
        print(f"laneserve-client: {error}", file=sys.stderr)
        return EXIT_USAGE
    except LaneserveError as error:
        print(f"laneserve-client: {error}", file=sys.stderr)
        _print_notes(error)
        # The input's fault, whoever refused it (this client before sending, or the
        # server: INVALID_INPUT, REQUEST_ID_REUSED), or a row of it that failed run alone
        # (ErrorInfo "row": ENGINE_FAILURE, DEVICE_MEMORY): the same input fails again.
        # Exit 3 told a wrapper to retry what the model fails on every time.
        fails_again = isinstance(error, InvalidInputError) or "row" in error.metadata
        return EXIT_USAGE if fails_again else EXIT_SERVER
    except KeyboardInterrupt as stopped:
        print("laneserve-client: interrupted", file=sys.stderr)
        _print_notes(stopped)
        return EXIT_SIGINT
    except Terminated as stopped:
        print("laneserve-client: terminated", file=sys.stderr)
        _print_notes(stopped)
        return EXIT_SIGTERM


def _print_notes(error: BaseException) -> None:
    for note in getattr(error, "__notes__", ()):
        print(f"  {note}", file=sys.stderr)


# The stop signal `_stopped_once`'s handler took (None: none yet), for
# `_raise_if_stopped`: the handler's own raise lands wherever the main thread is, and in
# a finalizer or a weakref callback Python prints it ("Exception ignored in ...") and
# drops it: the job went on to its end, exit 0, and every later signal was ignored (a
# README audit, 1 SIGTERM in ~90).
_stop_signal: int | None = None


def _raise_if_stopped() -> None:
    """Raises the stop a signal asked for, where its handler's raise was lost."""
    if _stop_signal is not None:
        raise KeyboardInterrupt if _stop_signal == signal.SIGINT else Terminated


@contextlib.contextmanager
def _stopped_once() -> Iterator[None]:
    """SIGINT and SIGTERM stop the command once: the first raises KeyboardInterrupt or
    Terminated, and any after it is ignored while that unwinds (the stream closed, the
    checkpoint's last save). Raised again, a second Ctrl-C, or the SIGTERM that `timeout`
    sends to the process and then to its group, abandoned that save (130 / 143 said
    "checkpoint saved", and a resume ran again what the save lost) or was raised inside
    gRPC's callbacks (a logged traceback). A signal ignored when the command started
    (SIGINT in a shell's background job) stays ignored."""
    stops = [
        each
        for each in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(each) is not signal.SIG_IGN
    ]
    previous = {each: signal.getsignal(each) for each in stops}

    def stop(signum: int, _frame: FrameType | None) -> None:
        global _stop_signal  # noqa: PLW0603 - a signal handler's one way out besides raising
        for each in stops:
            signal.signal(each, signal.SIG_IGN)
        _stop_signal = signum
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    try:
        for each in stops:  # within the `try`: a signal between the two is restored too
            signal.signal(each, stop)
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
        global _stop_signal  # noqa: PLW0603 - see `stop`
        _stop_signal = None


def _default_unless(suppressed: bool, value: object) -> object:
    """An option's default: `value`, or none at all where `suppressed` (argparse.SUPPRESS:
    an option not given sets nothing, so a value given before the command stays)."""
    return argparse.SUPPRESS if suppressed else value


def add_tls_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, suppress_defaults: bool = False
) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key, --tls-server-name (read by `tls_config`);
    shared with `laneserve top`. With `suppress_defaults`, an option not given sets
    nothing (see `_connection_options`)."""

    default = functools.partial(_default_unless, suppress_defaults)

    parser.add_argument(
        "--tls", action="store_true", default=default(False), help="use TLS with the system's roots"
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=default(None),
        help="CA certificates to trust (implies TLS)",
    )
    parser.add_argument(
        "--tls-cert", metavar="PEM", default=default(None), help="client certificate (mutual TLS)"
    )
    parser.add_argument(
        "--tls-key", metavar="PEM", default=default(None), help="client private key (mutual TLS)"
    )
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        default=default(None),
        help="name to check the server certificate against",
    )


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS settings the options of `add_tls_arguments` ask for; None: plaintext.
    Raises ValueError naming the options that cannot be used."""
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        # Checked here, where the options can be named: TlsConfig names its own fields.
        if (args.tls_cert is None) != (args.tls_key is None):
            given = "--tls-cert" if args.tls_key is None else "--tls-key"
            raise ValueError(
                f"--tls-cert and --tls-key go together (mutual TLS); got only {given}: "
                "expected both or neither"
            )
        tls = TlsConfig(
            root_certificates=_read_pem(args.tls_ca, "--tls-ca"),
            private_key=_read_pem(args.tls_key, "--tls-key"),
            certificate_chain=_read_pem(args.tls_cert, "--tls-cert"),
            server_name=args.tls_server_name,
        )
        check_pem_files(
            args.tls_ca, args.tls_cert, args.tls_key, names=("--tls-ca", "--tls-cert", "--tls-key")
        )
        return tls
    return TlsConfig() if args.tls else None


def _read_pem(path: str | None, option: str) -> bytes | None:
    """The bytes of the PEM file `option` names (None: not given); ValueError naming the
    option when it cannot be read (it said "TLS options: [Errno 2] ...", naming no flag)."""
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(
            f"{option} {path}: cannot read it ({error.strerror or error}); expected a PEM file"
        ) from error


def _client(args: argparse.Namespace) -> Client:
    try:
        check_target(args.target, what="--target")
        tls = tls_config(args)
    except ValueError as error:
        raise UsageError(str(error)) from error
    metadata = []
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata {pair!r}: expected KEY=VALUE")
        try:
            metadata.append(metadata_pair(key, value))
        except ValueError as error:
            raise UsageError(f"--metadata {pair!r}: {error}") from error
    return Client(
        args.target,
        tls=tls,
        metadata=metadata,
        retry=RetryPolicy(max_attempts=args.attempts),
    )


# ---- model and stats -------------------------------------------------------------------


def _model(client: Client, args: argparse.Namespace) -> int:
    model = client.model(timeout=args.timeout)
    out = io.StringIO()
    print(f"model        {model.model_path}", file=out)
    print(f"sha256       {model.model_sha256 or 'unknown'}", file=out)
    # The model's own version and producer, as its author set them ("none" / "-": unset).
    print(
        f"version      {'none' if model.model_version is None else model.model_version}", file=out
    )
    print(f"producer     {model.producer_name or '-'}", file=out)
    print(f"server       laneserve {model.server_version or 'unknown'}", file=out)
    print(f"providers    {', '.join(model.providers)}", file=out)
    print(f"batch cap    {model.batch_cap} rows (max_batch_size {model.max_batch_size})", file=out)
    print(f"window       {model.stream_window} requests per stream", file=out)
    print(file=out)
    # Each input as the start-up probe ran it, its dynamic sizes filled in: the server's
    # memory figures per row hold for rows of that shape, and sizes no --probe-shape gave
    # ran at 1 ("unknown": a server older than GetModel's probe_shapes).
    probed = {name: _shape((None, *dims)) for name, dims in model.probe_shapes}
    _table(
        out,
        ["tensor", "name", "dtype", "shape", "probe shape"],
        [
            [
                kind,
                spec.name,
                spec.datatype,
                _shape(spec.shape),
                "" if kind == "output" else probed.get(spec.name, "unknown"),
            ]
            for kind, specs in (("input", model.inputs), ("output", model.outputs))
            for spec in specs
        ],
    )
    print(file=out)
    _table(
        out,
        ["lane", "priority", "capacity_rows", "timeout_ms", "max_wait_ms", "min_share", ""],
        [
            [
                lane.name,
                str(lane.priority),
                str(lane.capacity_rows),
                str(lane.timeout_ms),
                str(lane.max_wait_ms),
                f"{lane.min_share:g}",
                "default" if lane.is_default else "",
            ]
            for lane in model.lanes
        ],
    )
    _write_once(out.getvalue())
    return EXIT_OK


def _write_once(text: str) -> None:
    """`text` to standard output in one write: line by line, unbuffered
    (PYTHONUNBUFFERED=1, common in containers), `model | head -1` got EPIPE on the second
    line and exited 141 about half the time, where README promises 0 for an answer that
    fits the pipe."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _stats(client: Client, args: argparse.Namespace) -> int:
    stats = client.stats(timeout=args.timeout)
    out = io.StringIO()
    run = stats.run_time
    print(f"state        {stats.state}   uptime {stats.uptime_s:.0f} s", file=out)
    print(
        f"batches      {stats.batches}   mean size {stats.mean_batch_size:.1f} rows   "
        f"cap {stats.batch_cap}   rows run {stats.rows_run}",
        file=out,
    )
    print(
        f"run time     p50 {run.p50_ms:.2f} ms   p95 {run.p95_ms:.2f} ms   p99 {run.p99_ms:.2f} ms",
        file=out,
    )
    print(
        f"idempotency  {stats.idempotent_replays} replayed   {stats.idempotent_joins} joined   "
        f"{stats.replay_cache_entries} answers cached ({stats.replay_cache_bytes} bytes)",
        file=out,
    )
    print(file=out)
    _table(
        out,
        [
            "lane",
            "depth",
            "admitted",
            "completed",
            "failed",
            "cancelled",
            "rejected",
            "shed",
            "queue wait ms",
        ],
        [
            [
                lane.name,
                f"{lane.depth_rows}/{lane.capacity_rows}",
                str(lane.admitted),
                str(lane.completed),
                str(lane.failed),
                str(lane.answered.get("CANCELLED", 0)),
                _counts(lane.rejected),
                _counts(lane.shed),
                _percentiles(lane.queue_wait),
            ]
            for lane in stats.lanes
        ],
    )
    _write_once(out.getvalue())
    return EXIT_OK


def _percentiles(summary: pb.LatencySummary) -> str:
    if not summary.count:
        return "-"
    return f"p50 {summary.p50_ms:.1f} / p95 {summary.p95_ms:.1f} / p99 {summary.p99_ms:.1f}"


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(counts.items())) or "0"


def _shape(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"


def _table(out: TextIO, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(),
            file=out,
        )


# ---- infer -----------------------------------------------------------------------------


def _infer(client: Client, args: argparse.Namespace) -> int:
    input_path = None if args.input is None else Path(args.input)
    output = None if args.output is None else Path(args.output)
    if output is not None:
        _check_output_path(output, "--output", input_path)
        # Written in place (bulk's output replaces the file: its own permissions are moot).
        if output.exists() and not os.access(output, os.W_OK):
            raise UsageError(
                f"--output {output}: cannot write it (permission denied); expected a file "
                "this user can write"
            )
    model = client.model(timeout=args.timeout)
    # bulk's checks against the model: the server would refuse the call for any of these.
    asked = _asked_outputs(model, args)
    if output is not None:  # else the answer, run, could not be written
        _check_one_array(output, asked, model)
    _check_lane(model, args.lane)
    if args.json is not None:
        inputs = _inputs_from_json(args.json, model, "--json")
    else:
        assert input_path is not None, "argparse lets exactly one of --json, --input through"
        inputs = _read_inputs(input_path, model)
    _row_count(inputs, args.input or "--json")
    _check_request_fits(model, args.lane, inputs, args.request_id, asked)
    outputs = client.infer(
        inputs,
        lane=args.lane,
        timeout=args.timeout,
        request_id=args.request_id,
        outputs=asked or None,
    )
    if output is None:
        # Strict JSON, for jq and JSON.parse: Python's default writes NaN and Infinity,
        # which they refuse (`_json_values` writes them as strings). Text as it is where
        # the terminal takes it ("café", not "caf\u00e9"): escaped only where it cannot.
        json.dump(
            {name: _json_values(array) for name, array in outputs.items()},
            sys.stdout,
            allow_nan=False,
            ensure_ascii=not _writes_unicode(sys.stdout),
        )
        print()
    else:
        _write_outputs(output, outputs)
    return EXIT_OK


def _writes_unicode(stream: Any) -> bool:
    """Whether `stream` encodes any text (UTF-8 and its kin); a stream that names no
    encoding (a StringIO) takes str as it is."""
    encoding = getattr(stream, "encoding", None)
    if encoding is None:
        return True
    try:
        "\u00e9\u2713\U0001f600".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _json_values(array: npt.NDArray[Any]) -> Any:
    """`array` as nested lists for JSON, every value exact (a float as the shortest text
    that reads back as it). JSON has no number for NaN or ±inf: those are the strings
    "NaN", "Infinity" and "-Infinity", Python's and JavaScript's names for them, which
    `--json` reads back as the values."""
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return array.tolist()
    values = array.astype(object)  # Python floats, as tolist gives
    values[np.isnan(array)] = "NaN"
    values[np.isposinf(array)] = "Infinity"
    values[np.isneginf(array)] = "-Infinity"
    return values.tolist()


class _RepeatedKeyError(ValueError):
    pass


def _object_once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys come once each: json keeps the last of a key given twice,
    and an input named twice was sent with its second value, the first dropped unsaid."""
    document = dict(pairs)
    if len(document) != len(pairs):
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise _RepeatedKeyError(f"key(s) {repeated} given more than once; expected each once")
    return document


def _inputs_from_json(text: str, model: ModelInfo, where: str) -> Arrays:
    try:
        document = json.loads(text, object_pairs_hook=_object_once_each)
    except _RepeatedKeyError as error:
        raise UsageError(f"{where}: {error}") from error
    except ValueError as error:
        raise UsageError(f"{where}: not JSON ({error})") from error
    except RecursionError as error:  # nested deeper than the parser recurses
        raise UsageError(
            f"cannot read {where}: {error}; expected nested lists as deep as the input's shape"
        ) from error
    if not isinstance(document, dict):
        if len(model.inputs) != 1:
            raise UsageError(
                f"{where}: expected an object of input name to nested lists; the model's "
                f"inputs are {[spec.name for spec in model.inputs]}"
            )
        document = {model.inputs[0].name: document}
    arrays: Arrays = {}
    for name, value in document.items():
        try:
            spec = model.input(name)
        except KeyError as error:
            raise UsageError(f"{where}: {error.args[0]}") from error
        arrays[name] = _json_array(value, spec, f"{where}: input {name!r}")
        _check_input(name, arrays[name], model, where)
    _check_all_inputs(model, list(arrays), where)
    _check_named_dimensions(arrays, model, where)
    return arrays


def _known_dtype(spec: TensorInfo, what: str) -> np.dtype[Any]:
    if spec.dtype is None:
        raise UsageError(
            f"{what} is {spec.datatype} on the server, a data type this laneserve-client "
            "does not know; expected a client as recent as the server"
        )
    return spec.dtype


def _json_array(value: object, spec: TensorInfo, what: str) -> npt.NDArray[Any]:
    """`value` (JSON's nested lists) as an array of `spec`'s dtype, refused where the
    dtype would change a value: numpy casts 1.5 to 1 for int64 and 1e10 to inf for float16
    without a word, and raises OverflowError for an int past int64's range."""
    dtype = _known_dtype(spec, what)
    if is_text_dtype(dtype):
        return _json_strings(value, spec, what)
    try:
        with np.errstate(over="raise", invalid="raise"):
            array = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError, FloatingPointError) as error:
        raise UsageError(
            f"{what} is not a {spec.dtype} array of shape {_shape(spec.shape)}: {error}"
        ) from error
    if array.dtype.kind in "biu":  # float values cast to whole numbers, numbers to bool
        given = np.asarray(value)
        changed = np.argwhere(given != array)
        if changed.size:
            index = tuple(int(axis) for axis in changed[0])
            raise UsageError(
                f"{what}: {given[index].item()!r} at {list(index)} would be sent as "
                f"{array[index].item()!r}; expected values {spec.dtype} holds exactly"
            )
    return array


def _json_strings(value: object, spec: TensorInfo, what: str) -> npt.NDArray[np.object_]:
    """`value` (JSON's nested lists of strings) as an object array of str, for a string
    input. Its shape is the first element's at each depth (as numpy reads one); a list of
    another length, a list where a string goes or a string where a list goes, and
    anything else where a string goes (a number) are refused naming where they are in the
    JSON: numpy made an uneven row an element that is a list, and the first row holding
    one was named, not the uneven one. Walked without recursion (JSON nests deep)."""
    dims: list[int] = []
    first = value
    while isinstance(first, list):
        dims.append(len(first))
        if not first:
            break
        first = first[0]
    expected = f"JSON strings in nested lists of shape {_shape(spec.shape)}"
    pending: list[tuple[object, list[int]]] = [(value, [])]
    while pending:
        element, place = pending.pop()
        depth = len(place)
        if depth == len(dims):
            if not isinstance(element, str):
                raise UsageError(f"{what}: {_json_kind(element)} at {place}; expected {expected}")
            continue
        if not isinstance(element, list) or len(element) != dims[depth]:
            if isinstance(element, list):
                held = f"a list of {len(element)}"
            else:
                held = "a string" if isinstance(element, str) else _json_kind(element)
            raise UsageError(
                f"{what}: {held} at {place}, where the first row's shape puts a list of "
                f"{dims[depth]}; expected {expected}"
            )
        pending.extend(
            (item, [*place, index]) for index, item in reversed(list(enumerate(element)))
        )
    array = np.empty(tuple(dims), dtype=object)
    array[...] = value  # rectangular now: each element one str (a 0-d array's too)
    return array


def _json_kind(element: object) -> str:
    """A JSON value that is not a string, as a message names it."""
    if isinstance(element, list):
        return "a list (lists nested unevenly, or deeper than the shape)"
    if isinstance(element, dict):
        return "an object"
    return f"{json.dumps(element)}, not a string"


def _read_inputs(path: Path, model: ModelInfo, kinds: str = ".npy, .npz or .json") -> Arrays:
    """The model's inputs from .npy (one input), .npz (by name) or .json; .npy is
    memory-mapped, so a large bulk input is not read into memory at once. `kinds`: the
    files the command reads, for a message."""
    if not path.is_file():
        if path.is_dir():
            raise UsageError(f"input {path} is a directory; expected a {kinds} file")
        if path.exists():  # a FIFO, a device
            raise UsageError(f"input {path} is not a regular file; expected a {kinds} file")
        raise UsageError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return _inputs_from_json(path.read_text(encoding="utf-8"), model, str(path))
        if suffix == ".npy":
            # Its start read once, for both checks. np.load reads the header again:
            # memory-mapped, numpy opens the file by its name alone (open_memmap).
            with path.open("rb") as file:
                _check_magic(file, path, suffix)
                if len(model.inputs) != 1:
                    raise UsageError(
                        f"{path} holds one array; the model has inputs "
                        f"{[spec.name for spec in model.inputs]}: use .npz with those names"
                    )
                file.seek(0)
                _check_not_pickled(file, model.inputs[0].name, path)
            arrays: Arrays = {model.inputs[0].name: np.load(path, mmap_mode="r")}
        elif suffix == ".npz":
            with path.open("rb") as file:
                _check_magic(file, path, suffix)
            try:
                with np.load(path) as archive:
                    _check_only_inputs(model, archive.files, str(path))
                    _check_all_inputs(model, archive.files, str(path))
                    members = archive.zip.namelist()
                    for spec in model.inputs:
                        # The member np.load reads for the name: NAME, else NAME.npy.
                        member = spec.name if spec.name in members else f"{spec.name}.npy"
                        with archive.zip.open(member) as file:
                            _check_not_pickled(file, spec.name, path)
                    arrays = {spec.name: archive[spec.name] for spec in model.inputs}
            except _DAMAGED_ARCHIVE as error:
                raise UsageError(f"cannot read {path}: {error}") from error
        else:
            raise UsageError(f"input file {path}: expected a {kinds} file")
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path}: {error}") from error
    for name, array in arrays.items():
        _check_input(name, array, model, str(path))
    _check_named_dimensions(arrays, model, str(path))
    return arrays


def _check_not_pickled(file: IO[bytes], name: str, path: Path) -> None:
    """Refuses an array numpy saved as a pickle (an object or StringDType array: text
    held as Python objects), naming it and what to save instead: np.load refused it
    advising allow_pickle=, which would run code from the file. A header it cannot read
    is left to np.load, which says why."""
    try:
        version = np.lib.format.read_magic(file)
        if version == (1, 0):
            _, _, dtype = np.lib.format.read_array_header_1_0(file)
        elif version == (2, 0):
            _, _, dtype = np.lib.format.read_array_header_2_0(file)
        else:  # 3.0: numpy writes it only for a structured dtype's non-Latin-1 field names
            return
    except ValueError:
        return
    # Not `is_text_dtype`: numpy pickles any dtype holding Python objects (a structured
    # one too), and saves str_ and bytes_ text without pickle.
    if dtype.hasobject:
        raise UsageError(
            f"input {name!r} in {path} holds Python objects (dtype {dtype}: an object or a "
            "StringDType array, which numpy saves as a pickle), which this client does not "
            "load (loading a pickle runs code from the file); for text, expected a numpy "
            "str_ array: save array.astype(str)"
        )


def _check_magic(file: IO[bytes], path: Path, suffix: str) -> None:
    """Refuses `file` (`path`, open at its start) unless it starts as numpy writes a
    `suffix` file."""
    magic, expected = _MAGIC[suffix]
    start = file.read(max(len(prefix) for prefix in magic))
    if not start.startswith(magic):
        found = "is empty" if not start else f"starts with {start!r}"
        raise UsageError(f"{path} is not a {suffix} file: it {found}; expected {expected}")


def _check_all_inputs(model: ModelInfo, names: Sequence[str], where: str) -> None:
    """Refuses inputs that lack one of the model's: the server would refuse the request."""
    missing = [spec.name for spec in model.inputs if spec.name not in names]
    if missing:
        raise UsageError(
            f"{where} lacks input(s) {missing}; it holds {list(names)}, the model's inputs "
            f"are {[spec.name for spec in model.inputs]}"
        )


def _check_only_inputs(model: ModelInfo, names: Sequence[str], where: str) -> None:
    """Refuses arrays the model has no input for, as --json refuses such a name: sending
    the others alone would hide a file made for another model (or a misspelt name)."""
    inputs = [spec.name for spec in model.inputs]
    unknown = sorted(name for name in names if name not in inputs)
    if unknown:
        raise UsageError(
            f"{where} holds array(s) {unknown} the model has no input for; the model's "
            f"inputs are {inputs}"
        )


def _check_input(name: str, array: npt.NDArray[Any], model: ModelInfo, where: str) -> None:
    """The server's own check, before anything is sent: dtype, rank and the fixed sizes
    after the row axis (the row count is free). The byte order is free too: the codec
    writes each request in the wire's (a `>f4` file holds float32 values)."""
    spec = model.input(name)
    dtype = _known_dtype(spec, f"input {name!r}")
    if is_text_dtype(dtype):
        # Any text: the codec sends str_, bytes_ (UTF-8) and str elements alike. An object
        # array here is `_json_strings`' (a file's is refused as a pickle).
        same_type = is_text_dtype(array.dtype)
    else:
        same_type = array.dtype.newbyteorder("=") == dtype.newbyteorder("=")
    if (
        not same_type
        or array.ndim != len(spec.shape)
        or any(
            want is not None and have != want
            for have, want in zip(array.shape[1:], spec.shape[1:], strict=True)
        )
    ):
        # Only an object array is named "string": `_json_strings`' (no file's gets here).
        # A file's str_ or bytes_ array, text too, is named by its numpy dtype (<U5).
        given = _STRING if array.dtype.kind == "O" else array.dtype
        raise UsageError(
            f"input {name!r} in {where} is {given} with shape {list(array.shape)}; "
            f"the model expects {spec.datatype} with shape {_shape(spec.shape)}"
        )


def _check_named_dimensions(inputs: Arrays, model: ModelInfo, where: str) -> None:
    """The server's check of the dimensions the model names alike (K in a[N, K] and
    b[N, K]): one size across `inputs`, or it refuses every request (INVALID_INPUT), each
    item of a bulk job that could only fail. The row axis is `_row_count`'s; `inputs`
    hold every input, each of its rank (`_check_input`). A server older than dim_names
    names no dimension: nothing is checked here, and the server still refuses."""
    conflict = named_dimension_conflict(inputs, model.inputs)
    if conflict is not None:
        first, other, how = conflict
        raise UsageError(f"inputs {first!r} and {other!r} in {where} {how}")


def _write_outputs(path: Path, answer: Mapping[str, npt.NDArray[Any]]) -> None:
    """Writes the answer `_check_one_array` let through; a string output as a str_ array
    (`text_array`): np.save wrote its object array as a pickle, which np.load refuses
    without allow_pickle=, and the .npz writer raised (a traceback, a partial file)."""
    outputs = dict(answer)
    for name, array in answer.items():
        try:
            # A decoded answer's text is an object array alone (`decode_tensor`).
            if array.dtype.hasobject:
                outputs[name] = text_array(f"output {name!r}", array)
        except ValueError as error:
            raise UsageError(
                f"cannot write {path}: {error}; leave out --output to have the answer printed "
                "as JSON"
            ) from error
    try:
        if path.suffix.lower() == ".npy":
            if len(outputs) != 1:  # a server that answered more than was asked
                raise UsageError(
                    f"{path}: .npy holds one array, the answer has {sorted(outputs)}; use "
                    ".npz or --output-name"
                )
            # Opened here: np.save given a name adds ".npy" to one that lacks it, case
            # sensitively (Q.NPY became Q.NPY.npy).
            with path.open("wb") as file:
                np.save(file, next(iter(outputs.values())))
        else:
            write_npz(path, outputs)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from error


def _check_one_array(output: Path, asked: Sequence[str], model: ModelInfo) -> None:
    """Refuses a .npy `output` for an answer of several outputs: .npy holds one array."""
    names = list(asked) or [spec.name for spec in model.outputs]
    if output.suffix.lower() == ".npy" and len(names) != 1:
        whose = "--output-name asks for" if asked else "the model has"
        raise UsageError(
            f"--output {output}: .npy holds one array and {whose} outputs {names}; choose "
            "one with --output-name, or write .npz"
        )


def _check_output_path(path: Path, option: str, input_path: Path | None = None) -> None:
    """Refuses an output that could not be written, or that is the input file (by any
    path: a link, another spelling), before any work is done."""
    if path.suffix.lower() not in (".npy", ".npz"):
        raise UsageError(f"{option} {path}: expected a .npy or .npz file")
    parent = path.parent
    if not parent.is_dir():
        found = "does not exist" if not parent.exists() else "is not a directory"
        raise UsageError(f"{option} {path}: {parent} {found}; expected an existing directory")
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory; expected a file name")
    # Both write into the directory: infer the output, bulk its checkpoint beside it.
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(
            f"{option} {path}: cannot write in {parent} (permission denied); expected a "
            "directory this user can write"
        )
    if input_path is not None and same_file(path, input_path):
        raise UsageError(
            f"{option} {path} is the input file {input_path}: writing it would destroy the "
            "input; expected another file"
        )


# ---- bulk ------------------------------------------------------------------------------


def _bulk(client: Client, args: argparse.Namespace) -> int:
    output, input_path = Path(args.output), Path(args.input)
    _check_output_path(output, "--output", input_path)
    model = client.model(timeout=args.timeout)
    asked = _asked_outputs(model, args)
    output_names = asked or [spec.name for spec in model.outputs]
    _check_one_array(output, asked, model)
    if input_path.suffix.lower() not in (".npy", ".npz"):
        raise UsageError(f"--input {input_path}: expected a .npy or .npz file")
    inputs = _read_inputs(input_path, model, ".npy or .npz")
    rows = _row_count(inputs, input_path)
    _check_items(model, inputs, rows, args, output_names)
    with contextlib.ExitStack() as lock:
        checkpoint = _open_checkpoint(output, input_path, rows, args, asked, model, lock)
        return _bulk_run(client, args, checkpoint, inputs, output_names)


def _bulk_run(
    client: Client,
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    inputs: Arrays,
    output_names: Sequence[str],
) -> int:
    """Runs the job of `checkpoint` (locked) and writes its output."""
    output, rows = Path(args.output), checkpoint.rows
    try:
        failed = _run_items(client, args, checkpoint, inputs, output_names)
    except (KeyboardInterrupt, Terminated, LaneserveError) as stopped:
        # Exit 130, 143 or 3 (not 2: the input's fault fails again however resumed).
        if not isinstance(stopped, InvalidInputError):
            stopped.add_note(
                f"the checkpoint {checkpoint.directory} keeps the {checkpoint.done_rows} of "
                f"{rows} rows done: rerun with --resume to go on from there"
            )
        raise
    sidecar = failed_rows_path(output)
    if not failed:
        try:
            checkpoint.finish(output)
            sidecar.unlink(missing_ok=True)  # an earlier run's: no row is failed now
        except OSError as error:
            raise UsageError(
                f"cannot write {output}: {error}; the checkpoint {checkpoint.directory} is "
                "kept: rerun with --resume once the output can be written"
            ) from error
        print(f"laneserve-client: {rows} rows done; wrote {output}", file=sys.stderr)
        return EXIT_OK
    failures = collections.Counter(error.reason or error.code.name for error in failed.values())
    wrote = _write_with_failed_rows(checkpoint, output, failed)
    print(
        f"laneserve-client: {len(failed)} of {checkpoint.items} items failed "
        f"({_counts(failures)}); {checkpoint.done_rows} of {rows} rows done. {wrote} "
        f"Checkpoint: {checkpoint.directory}; rerun with --resume to retry the failed rows.",
        file=sys.stderr,
    )
    for item in sorted(failed)[:_EXAMPLES]:
        print(f"  {_failed_rows_line(checkpoint, item, failed[item])}", file=sys.stderr)
    if len(failed) > _EXAMPLES:
        print(f"  and {len(failed) - _EXAMPLES} more failed item(s), in {sidecar}", file=sys.stderr)
    return EXIT_FAILED_ROWS


def failed_rows_path(output: Path) -> Path:
    """Where a bulk job that left rows failed lists them: OUTPUT.failed.json."""
    return output.with_name(f"{output.name}.failed.json")


def _server_row(checkpoint: Checkpoint, item: int, error: LaneserveError) -> int | None:
    """The input file's row that `error` names (ErrorInfo.metadata "row": its row within
    the item, one that failed run alone, or whose text the server or this client could
    not read), or None. Not read from the message's words, which may be put otherwise."""
    row = error.metadata.get("row", "")
    if not row.isdigit():
        return None
    return int(checkpoint.item_rows(item).start) + int(row)


def _failed_rows_line(checkpoint: Checkpoint, item: int, error: LaneserveError) -> str:
    """Item `item`'s failure, its rows named by their index in the input file."""
    span = checkpoint.item_rows(item)
    row = _server_row(checkpoint, item, error)
    named = "" if row is None else f"; its error names input row {row}"
    return f"input rows {span.start}-{span.stop - 1} (item {item}{named}): {error}"


def _write_with_failed_rows(
    checkpoint: Checkpoint, output: Path, failed: Mapping[int, LaneserveError]
) -> str:
    """Writes OUTPUT with the failed items' rows as NaN (zeros in an output of no float
    dtype, "" in a string output), and OUTPUT.failed.json listing those items (their first
    input row, rows, code, reason and message); returns what it wrote, for the summary.
    The checkpoint stays: --resume retries only the failed items and then writes both
    afresh (the sidecar removed). A failed row's outputs are never an answer: NaN tells
    them from real values; the sidecar says which they are where zeros (or "") do not.

    Raises:
        UsageError: either file cannot be written (the checkpoint is kept).
    """
    sidecar = failed_rows_path(output)
    listed = []
    for item in sorted(failed):
        error, span = failed[item], checkpoint.item_rows(item)
        listed.append(
            {
                "item": item,
                "first_row": span.start,
                "rows": span.stop - span.start,
                "server_row": _server_row(checkpoint, item, error),
                "code": error.code.name,
                "reason": error.reason,
                "message": error.message,
            }
        )
        for array in checkpoint.arrays.values():
            # Not done, so never read back as an answer: a retry overwrites them.
            array[span] = _failed_value(array.dtype)
    summary = {
        "job_id": checkpoint.job_id,
        "input": checkpoint.input_path,
        "rows": checkpoint.rows,
        "failed_rows": sum(entry["rows"] for entry in listed),
        "failed_items": listed,
    }
    try:
        checkpoint.narrow_text()
        checkpoint.save()
        replace_file(sidecar, lambda path: path.write_bytes(json.dumps(summary, indent=1).encode()))
        if not checkpoint.arrays:  # no item succeeded: no output's shape or dtype is known
            # A file already there is left as it was (removed, a user's file was lost).
            left = f" ({output} already there is left as it was)" if output.exists() else ""
            return (
                f"No item succeeded: no {output} written{left}; the failed rows are in {sidecar}."
            )
        # Copied, not linked as Checkpoint.finish links a finished array: the checkpoint
        # stays for a resume, which writes its arrays in place.
        checkpoint.write_output(output, link=False)
    except OSError as error:
        raise UsageError(
            f"cannot write {output} or {sidecar}: {error}; the checkpoint "
            f"{checkpoint.directory} is kept: rerun with --resume once they can be written"
        ) from error
    return (
        f"Wrote {output} with the failed rows as NaN (zeros in an output that is not "
        f"float, empty strings in a string output), and the failed rows in {sidecar}."
    )


def _failed_value(dtype: np.dtype[Any]) -> float | str:
    """What a failed row's elements are in OUTPUT: NaN where the dtype has it; a string
    output's (a str_ array, where 0 is the text "0") the empty string; else 0."""
    if np.issubdtype(dtype, np.inexact):
        return math.nan
    return "" if dtype.kind == "U" else 0


def _run_items(
    client: Client,
    args: argparse.Namespace,
    checkpoint: Checkpoint,
    inputs: Arrays,
    output_names: Sequence[str],
) -> dict[int, LaneserveError]:
    """Streams the items the checkpoint lacks and stores their answers; returns the
    failed items' errors by item. The checkpoint is saved as it goes and at the end, on
    every path (Ctrl-C, SIGTERM, a lost server: --resume goes on)."""
    pending = [int(item) for item in np.flatnonzero(~checkpoint.done)]
    progress = Progress(
        checkpoint.rows, checkpoint.done_rows, enabled=not args.no_progress, stream=sys.stderr
    )
    failed: dict[int, LaneserveError] = {}
    saved_s = time.monotonic()

    def requests() -> Iterator[StreamRequest]:
        for item in pending:
            span = checkpoint.item_rows(item)
            yield StreamRequest(
                {name: np.asarray(array[span]) for name, array in inputs.items()},
                request_id=f"{checkpoint.job_id}-{item}",
            )

    try:
        for result in client.stream(
            requests(),
            lane=args.lane,
            window=args.window,
            timeout_ms=args.timeout_ms,
            ordered=False,
            outputs=output_names,
            job_id=checkpoint.job_id,
        ):
            item = pending[result.index]
            if result.outputs is not None:
                checkpoint.store(item, result.outputs)
                progress.advance(_rows_in(checkpoint, item))
            else:
                assert result.error is not None
                failed[item] = result.error
                progress.fail(_rows_in(checkpoint, item))
            if time.monotonic() - saved_s >= args.checkpoint_interval_s:
                checkpoint.save()
                saved_s = time.monotonic()
            _raise_if_stopped()
        _raise_if_stopped()
    except CheckpointError as error:  # an answer that does not fit the checkpoint
        raise UsageError(str(error)) from error
    except OSError as error:  # a full disk, a directory made read-only: rows kept so far
        raise _unwritable(checkpoint, error) from error
    finally:
        progress.close()
        raised = sys.exc_info()[1]
        try:
            checkpoint.save()  # also on Ctrl-C, SIGTERM and a lost server: --resume goes on
        except OSError as error:
            if raised is None:  # else that error is the one to report
                raise _unwritable(checkpoint, error) from error
    return failed


def _unwritable(checkpoint: Checkpoint, error: OSError) -> UsageError:
    try:
        gone = not checkpoint.directory.is_dir()
    except OSError:  # its parent not searchable: it may be there still
        gone = False
    if gone:
        # Removed while the job ran: nothing saved is left to resume from.
        return UsageError(
            f"cannot write the checkpoint {checkpoint.directory}: {error}; it is gone "
            "(removed while the job ran?), and the rows it saved with it; expected it to "
            "stay until the job ends: run the job again, without --resume"
        )
    return UsageError(
        f"cannot write the checkpoint {checkpoint.directory}: {error}; expected room and "
        "write permission there: the rows it saved are kept, so --resume once it can be "
        "written"
    )


def _rows_in(checkpoint: Checkpoint, item: int) -> int:
    span = checkpoint.item_rows(item)
    return int(span.stop - span.start)


def _row_count(inputs: Arrays, where: str | Path) -> int:
    """The rows of every input; refused where the server would refuse them."""
    counts = {name: int(array.shape[0]) for name, array in inputs.items()}
    if len(set(counts.values())) != 1:
        raise UsageError(f"inputs in {where} have different row counts {counts}; expected one")
    rows = next(iter(counts.values()))
    if rows == 0:
        raise UsageError(f"{where} has 0 rows; expected at least one")
    return rows


def _asked_outputs(model: ModelInfo, args: argparse.Namespace) -> list[str]:
    """--output-name's values, once each; empty: all of the model's outputs, named or
    not (a resume naming a one-output model's output was "another job" of the job that
    named none: "different --output-name (all then, output now)")."""
    asked = list(dict.fromkeys(args.output_name or ()))
    model_outputs = [spec.name for spec in model.outputs]
    unknown = [name for name in asked if name not in model_outputs]
    if unknown:
        raise UsageError(
            f"--output-name {', '.join(unknown)}: the model has no such output; its outputs "
            f"are {model_outputs}"
        )
    return [] if set(asked) == set(model_outputs) else asked


def _check_lane(model: ModelInfo, lane: str | None) -> None:
    """Refuses a --lane the server does not have; None or "": the server's choice."""
    names = [info.name for info in model.lanes]
    if lane and lane not in names:
        raise UsageError(f"--lane {lane!r}: the server has no such lane; its lanes are {names}")


def _check_request_fits(
    model: ModelInfo,
    lane_name: str | None,
    inputs: Arrays,
    request_id: str | None,
    outputs: Sequence[str],
) -> None:
    """Refuses one request the server would refuse for its size: more rows than its lane
    holds, or a message over the limit, encoded as the client sends it (sent, gRPC's
    refusal of its size, RESOURCE_EXHAUSTED, was exit 3, as if the server were at fault)."""
    rows = len(next(iter(inputs.values())))
    name = lane_name or model.default_lane
    lane = next((lane for lane in model.lanes if lane.name == name), None)
    if lane is not None and rows > lane.capacity_rows:
        raise UsageError(
            f"the request has {rows} rows; lane {name!r} holds at most {lane.capacity_rows} "
            "rows: expected at most that many (`laneserve-client bulk` splits rows into items)"
        )
    limit_bytes = _message_limit(model)
    # Its UTF-8 bytes, as sent: counted in characters, an id of 64 four-byte characters
    # was 192 bytes short, and a request that far under the limit was sent and refused.
    id_bytes = len(request_id.encode("utf-8", "surrogatepass")) if request_id else 32  # uuid4().hex
    size = _request_bytes(inputs, slice(0, rows), id_bytes, lane_name, 0, outputs)
    if size > limit_bytes:
        raise UsageError(
            f"the request is {size} bytes encoded, over the {limit_bytes}-byte message "
            "limit: expected less (`laneserve-client bulk` splits rows into items)"
        )


def _request_bytes(
    inputs: Arrays,
    rows: slice,
    request_id_bytes: int,
    lane: str | None,
    timeout_ms: int,
    outputs: Sequence[str],
) -> int:
    """The encoded size of a request of `rows` of `inputs`, as the client builds it, its
    request_id `request_id_bytes` long in UTF-8."""
    tensors = encode_inputs({name: array[rows] for name, array in inputs.items()}, "")
    message = infer_request(
        "0" * request_id_bytes, tensors, lane=lane, timeout_ms=timeout_ms, outputs=outputs
    )
    return message.ByteSize()


def _message_limit(model: ModelInfo) -> int:
    """The smaller of the client's and the server's message limits, in bytes."""
    return min(DEFAULT_MAX_MESSAGE_BYTES, model.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)


def _check_items(
    model: ModelInfo,
    inputs: Arrays,
    rows: int,
    args: argparse.Namespace,
    output_names: Sequence[str],
) -> None:
    """Refuses a job whose every item the server would refuse (an unknown lane, items
    larger than the lane or the message limit): it could only fail, and --resume too."""
    _check_lane(model, args.lane)
    names = [lane.name for lane in model.lanes]
    # The server's rule for a stream that names no lane.
    name = args.lane or (SERVER_STREAM_LANE if SERVER_STREAM_LANE in names else model.default_lane)
    item_rows = min(args.rows_per_item, rows)
    lane = next((lane for lane in model.lanes if lane.name == name), None)
    if lane is not None and item_rows > lane.capacity_rows:
        raise UsageError(
            f"--rows-per-item {args.rows_per_item}: lane {name!r} holds at most "
            f"{lane.capacity_rows} rows, so no item would ever be queued; expected at most "
            f"{lane.capacity_rows} rows per item"
        )
    # Encoded as the stream client sends it: the id of the job's last item (a new job's id
    # is 32 characters, a resumed one's too) and the tensors' framing count.
    id_bytes = 32 + 1 + len(str(max(math.ceil(rows / args.rows_per_item) - 1, 0)))

    def item_bytes(span: slice) -> int:
        return _request_bytes(inputs, span, id_bytes, args.lane, args.timeout_ms or 0, output_names)

    limit_bytes = _message_limit(model)
    size = item_bytes(slice(0, item_rows))
    if size <= limit_bytes:
        return
    if any(is_text_dtype(array.dtype) for array in inputs.values()):
        _check_text_items(rows, args.rows_per_item, limit_bytes, item_bytes, size)
        return
    # Every row is as large as the first: so is every item but a shorter last.
    row_bytes = sum(array.dtype.itemsize * math.prod(array.shape[1:]) for array in inputs.values())
    fitting = max((limit_bytes - (item_bytes(slice(0, 1)) - row_bytes)) // max(row_bytes, 1), 0)
    while fitting > 0 and item_bytes(slice(0, fitting)) > limit_bytes:  # the lengths' varints
        fitting -= 1
    raise UsageError(
        f"--rows-per-item {args.rows_per_item}: an item is {size} bytes encoded, over "
        f"the {limit_bytes}-byte message limit; expected at most {fitting} rows per item"
        + ("" if fitting else " (one row alone is over it)")
    )


def _check_text_items(
    rows: int,
    rows_per_item: int,
    limit_bytes: int,
    item_bytes: Callable[[slice], int],
    first_bytes: int,
) -> None:
    """`_check_items`' size check for a job with string inputs, whose first item is over
    `limit_bytes`: text rows differ in size, so each item is encoded (`item_bytes`) until
    one fits, and only a job none of whose items fits is refused. An item over the limit
    in a job that goes on fails alone (this client refuses to send it), listed with the
    job's failed rows. `first_bytes`: the first item's size, measured already."""
    # (bytes, span) of the smallest item
    smallest = (first_bytes, slice(0, min(rows_per_item, rows)))
    for start in range(rows_per_item, rows, rows_per_item):
        span = slice(start, min(start + rows_per_item, rows))
        size = item_bytes(span)
        if size <= limit_bytes:
            return
        if size < smallest[0]:
            smallest = (size, span)
    size, span = smallest
    # The most of the smallest item's first rows that fit, by bisection (the bytes of a
    # run of rows grow with its length).
    low, high = 0, span.stop - span.start - 1  # `high` rows: over the limit at most
    while low < high:
        middle = (low + high + 1) // 2
        if item_bytes(slice(span.start, span.start + middle)) <= limit_bytes:
            low = middle
        else:
            high = middle - 1
    raise UsageError(
        f"--rows-per-item {rows_per_item}: every item is over the {limit_bytes}-byte message "
        f"limit encoded, the smallest (input rows {span.start}-{span.stop - 1}) {size} bytes; "
        + (
            f"expected at most {low} rows per item: that item's first {low} fit in one "
            "message (rows of longer text fit fewer)"
            if low
            else f"expected shorter text: input row {span.start} alone is over it"
        )
    )


def _open_checkpoint(
    output: Path,
    input_path: Path,
    rows: int,
    args: argparse.Namespace,
    asked: list[str],
    model: ModelInfo,
    lock: contextlib.ExitStack,
) -> Checkpoint:
    """The job's checkpoint, new or resumed, locked in `lock` for the rest of the run.

    Raises:
        UsageError: another run uses it, it is another job's, or it cannot be made.
    """
    directory = Path(f"{output}.partial")
    if directory.exists():
        if not directory.is_dir():  # no job's: a checkpoint is a directory
            raise UsageError(
                f"{directory} is in the way: a checkpoint directory goes there, and it is "
                "not one; expected it moved or deleted"
            )
        if not args.resume:
            raise UsageError(
                f"{directory} holds the checkpoint of an unfinished job; pass --resume to "
                "continue it, or delete it to start over"
            )
        try:
            # Locked before its state is read: another run may be rewriting it.
            lock.enter_context(locked(directory))
            checkpoint = Checkpoint.load(
                directory,
                input_path=input_path,
                rows=rows,
                rows_per_item=args.rows_per_item,
                output_names=tuple(asked),
                model_outputs=tuple(spec.name for spec in model.outputs),
            )
        except CheckpointError as error:
            raise UsageError(str(error)) from error
        except OSError as error:
            raise UsageError(f"cannot read {input_path}: {error}") from error
        _check_outputs_unchanged(checkpoint, model)
        print(
            f"laneserve-client: resuming job {checkpoint.job_id}: {checkpoint.done_rows} of "
            f"{rows} rows already done",
            file=sys.stderr,
        )
        return checkpoint
    if args.resume:
        print(
            f"laneserve-client: no checkpoint at {directory}; starting from the beginning",
            file=sys.stderr,
        )
    try:
        checkpoint = Checkpoint.create(
            directory,
            job_id=uuid.uuid4().hex,
            input_path=input_path,
            rows=rows,
            rows_per_item=args.rows_per_item,
            output_names=tuple(asked),
        )
    except OSError as error:
        raise UsageError(f"cannot create the checkpoint {directory}: {error}") from error
    try:
        # Made, then locked: a --resume run that came in between holds it, and runs the
        # job this one made; this one refuses, as it would had it come second.
        lock.enter_context(locked(directory))
    except CheckpointError as error:
        raise UsageError(str(error)) from error
    return checkpoint


def _check_outputs_unchanged(checkpoint: Checkpoint, model: ModelInfo) -> None:
    """Refuses a resume on a model whose outputs differ from the ones the checkpoint holds
    (data type, or a fixed size after the row axis): the answers would not be the job's.
    A string output's array is a str_ array of some width (`Checkpoint.store`): string."""
    for name, (dtype, shape) in checkpoint.output_specs.items():
        spec = next((spec for spec in model.outputs if spec.name == name), None)
        if spec is None:
            continue  # Checkpoint.load refused outputs the model lacks
        same_sizes = len(shape) == len(spec.shape) and all(
            want is None or have == want
            for have, want in zip(shape[1:], spec.shape[1:], strict=True)
        )
        # The dtype of an array Checkpoint.load opened: one numpy reads.
        held = datatype_name(np.dtype(dtype))
        if spec.datatype != held or not same_sizes:
            raise UsageError(
                f"checkpoint {checkpoint.directory} holds output {name!r} as {held} with "
                f"shape {list(shape)}; the model now gives {spec.datatype} with shape "
                f"{_shape(spec.shape)}: expected the model the job began with, or delete "
                f"{checkpoint.directory} to start over"
            )


class Progress:
    """A one-line progress bar on a terminal (rows, rows/s, ETA, errors), redrawn at most
    ten times a second; elsewhere (a log file, a pipe) a plain line every few seconds."""

    def __init__(self, total_rows: int, done_rows: int, *, enabled: bool, stream: TextIO) -> None:
        self._total = total_rows
        self._done = done_rows
        self._failed = 0
        self._session_rows = 0  # rows done by this run: the rate ignores earlier runs
        self._enabled = enabled
        self._stream = stream
        self._tty = stream.isatty()
        self._started_s = time.monotonic()
        self._drawn_s = -math.inf
        self._period_s = 0.1 if self._tty else 5.0

    def advance(self, rows: int) -> None:
        self._done += rows
        self._session_rows += rows
        self._draw()

    def fail(self, rows: int) -> None:
        self._failed += rows
        self._draw()

    def close(self) -> None:
        self._draw(force=True)
        if self._enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def line(self) -> str:
        elapsed_s = max(time.monotonic() - self._started_s, 1e-9)
        rate = self._session_rows / elapsed_s
        left = self._total - self._done - self._failed
        eta = _clock(left / rate) if rate > 0 and left > 0 else "--:--"
        fraction = self._done / self._total if self._total else 1.0
        filled = round(fraction * 30)
        return (
            f"[{'#' * filled}{'.' * (30 - filled)}] {fraction * 100:5.1f}%  "
            f"{self._done:,}/{self._total:,} rows  {rate:,.0f} rows/s  ETA {eta}  "
            f"errors {self._failed:,} rows"
        )

    def _draw(self, *, force: bool = False) -> None:
        now_s = time.monotonic()
        if not self._enabled or (not force and now_s - self._drawn_s < self._period_s):
            return
        self._drawn_s = now_s
        if self._tty:
            self._stream.write("\r" + self.line())
        else:
            self._stream.write(self.line() + "\n")
        self._stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


# ---- arguments -------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line's options, the connection options from before the command and
    after it together (see `_connection_options`)."""
    args = _parser().parse_args(argv)
    # Every pair is sent, those given before the command first: a repeated option adds,
    # where a single-valued one given after the command replaces.
    args.metadata = [*args.metadata_before_command, *args.metadata]
    del args.metadata_before_command
    return args


def _connection_options(*, after_command: bool) -> argparse.ArgumentParser:
    """The connection options, a parent of the top-level parser (before the command:
    `laneserve-client --target H:P model` was refused as "invalid choice: 'H:P'") and of
    each command's (after it). After it, an option not given sets nothing
    (argparse.SUPPRESS), so that what was given before the command, or its default,
    stays; given in both places, the one after the command wins (argparse copies a
    command's settings over the top-level parser's). --metadata adds instead: before the
    command it fills `metadata_before_command`, which `_parse_args` joins to it."""

    default = functools.partial(_default_unless, after_command)

    options = argparse.ArgumentParser(add_help=False)
    connection = options.add_argument_group("connection (before or after the command)")
    connection.add_argument(
        "--target",
        default=default(DEFAULT_TARGET),
        help=f"server HOST:PORT (default {DEFAULT_TARGET})",
    )
    add_tls_arguments(connection, suppress_defaults=after_command)
    connection.add_argument(
        "--metadata",
        action="append",
        default=[],
        # Each its own list: both start empty, and `_parse_args` joins them.
        dest="metadata" if after_command else "metadata_before_command",
        metavar="KEY=VALUE",
        help="gRPC metadata sent with every call (repeatable)",
    )
    connection.add_argument(
        "--attempts",
        type=_positive_int,
        default=default(6),
        help="attempts per call or item (default 6)",
    )
    connection.add_argument(
        "--timeout",
        type=_timeout_s,
        default=default(None),
        help=(
            "seconds per call of model, stats and infer, retries included (default: none); "
            "a bulk job's items are bounded by --timeout-ms"
        ),
    )
    connection.add_argument(
        "--log-level",
        default=default("warning"),
        choices=["debug", "info", "warning", "error"],
    )
    return options


def _parser() -> argparse.ArgumentParser:
    common = _connection_options(after_command=True)
    parser = argparse.ArgumentParser(
        prog="laneserve-client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_connection_options(after_command=False)],
    )
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser(
        "model", parents=[common], help="the served model (its sha256, version) and lanes"
    )
    model.set_defaults(handler=_model)

    stats = commands.add_parser("stats", parents=[common], help="live counters as a table")
    stats.set_defaults(handler=_stats)

    infer = commands.add_parser("infer", parents=[common], help="one request")
    given = infer.add_mutually_exclusive_group(required=True)
    given.add_argument("--input", help=".npy (one input), .npz (by input name) or .json")
    given.add_argument(
        "--json",
        help='inputs as JSON: {"input": [[...]]}, or a list; strings for a string input',
    )
    infer.add_argument("--output", help="write outputs to .npy/.npz instead of JSON on stdout")
    infer.add_argument("--output-name", action="append", help="an output to return (repeatable)")
    infer.add_argument("--lane", help="lane (default: the server's default lane)")
    infer.add_argument("--request-id", help="request id (default: random)")
    infer.set_defaults(handler=_infer)

    bulk = commands.add_parser("bulk", parents=[common], help="a bulk job over the stream")
    bulk.add_argument("--input", required=True, help=".npy (one input) or .npz (by name)")
    bulk.add_argument("--output", required=True, help=".npy (one output) or .npz (all)")
    bulk.add_argument("--output-name", action="append", help="an output to keep (repeatable)")
    bulk.add_argument(
        "--lane",
        default=DEFAULT_STREAM_LANE,
        help="lane (default: the server's lane for streams, bulk when it has one)",
    )
    bulk.add_argument(
        "--window", type=_positive_int, default=256, help="requests in flight (default 256)"
    )
    bulk.add_argument(
        "--rows-per-item", type=_positive_int, default=64, help="rows per request (default 64)"
    )
    bulk.add_argument(
        "--timeout-ms",
        type=_timeout_ms,
        default=0,
        help="per-request budget in ms, retries included (default 0: the lane's timeout)",
    )
    bulk.add_argument(
        "--resume", action="store_true", help="continue the job in OUTPUT.partial, if any"
    )
    bulk.add_argument(
        "--checkpoint-interval-s",
        type=_interval_s,
        default=2.0,
        help="seconds between checkpoint saves (default 2)",
    )
    bulk.add_argument("--no-progress", action="store_true", help="no progress bar")
    bulk.set_defaults(handler=_bulk)
    return parser


def _timeout_ms(text: str) -> int:
    value = _integer(text)
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(
            "expected milliseconds from 0 (the lane's timeout) to 2**32 - 1, a whole number, "
            f"got {text!r}"
        )
    return value


def _timeout_s(text: str) -> float:
    value = _number(text)
    if not 0 < value <= MAX_TIMEOUT_S:  # also false for nan
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 and <= {MAX_TIMEOUT_S} (2**32 - 1 ms), got {text!r}"
        )
    return value


def _interval_s(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:  # also false for nan
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _integer(text: str) -> int | None:
    """None where `text` is no integer: the caller's message says what was expected (a
    ValueError would have argparse name the type function instead)."""
    try:
        return int(text)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
