"""The bulk job's checkpoint: which items are done, and their outputs, on disk.

Layout, beside the output file ``OUT``::

    OUT.partial/.lock           held (flock, exclusive) by the one run using the checkpoint
    OUT.partial/state.json      job id, input identity, rows per item, done bitmap, and
                                each output's dtype, shape and file
    OUT.partial/<file>.npy      one memory-mapped array per model output, rows in place
                                (a string output's: a numpy str_ array, see `store`)
    OUT.partial.finished-XXXX/  a finished job's checkpoint, renamed away (a fresh name)
                                once OUT was written, while it is removed (see
                                `Checkpoint.finish`)

An output's file is named after it when its name is a short file name of letters,
digits, '-', '_' and '.' that no other output's file has (in any case); otherwise after
those characters of it and a digest of the whole name. state.json records each file:
two outputs never share one, and a resumed job reads the files its first run wrote.

Invariant: an item marked done in ``state.json`` has its output rows on disk. `save`
flushes the arrays before it replaces ``state.json`` (written to a temporary file,
fsynced, then renamed), so a job killed at any moment resumes from a consistent state;
at worst the items answered since the last save are asked for again, and the server's
idempotency by request_id answers them without running them twice (same job id).

A string output (decoded as an ``object`` array of ``str``, which cannot be memory-mapped)
is held as a numpy ``str_`` array, a fixed number of characters per element: what a
``.npy`` file holds without pickle. An answer wider than its array moves the array to a
new file at least twice as wide (`_resized`), recorded in ``state.json`` at the next
`save`, which then removes the old file; `finish` narrows each to its widest element.
Until that save the old file, still in ``state.json``, holds every row it did.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import fcntl
import glob
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from laneserve.client.tensors import datatype_name

__all__ = [
    "Checkpoint",
    "CheckpointBusyError",
    "CheckpointError",
    "InputIdentity",
    "locked",
    "replace_file",
    "same_file",
    "text_array",
]

# Version 2 records each output's file. Version 1 is still read: each output's file was
# its name with other characters than letters, digits, '-', '_' and '.' replaced by '_'
# (two names that became one file shared it, and the later output overwrote the other).
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_SAMPLE_BYTES = 1 << 20
# The longest stem of an output's file: the rest of a long name is in the digest.
_STEM_CHARS = 100


class CheckpointError(ValueError):
    """The checkpoint cannot be used for this job; the message says why and what to do."""


class CheckpointBusyError(CheckpointError):
    """Another run holds the checkpoint's lock: it is using the checkpoint now."""


@dataclasses.dataclass(frozen=True, slots=True)
class InputIdentity:
    """Enough to tell a different input file from the one a checkpoint was made for.

    Size, modification time, and a digest of the first and last MiB: cheap on files of
    many GiB. The digest catches a wrong or regenerated file, the time an edit in place
    between them (rows 5000-5009 rewritten kept the size and both ends); a file written
    anew with the same contents (a copy without its times, `touch`) counts as changed.
    Not a guard against deliberate edits that restore the time.
    """

    size_bytes: int
    sample_digest: str
    # st_mtime_ns; None in a checkpoint of a client that did not record it (not compared).
    mtime_ns: int | None

    def differs(self, now: InputIdentity) -> bool:
        """Whether `now` (the input as it is) is not the file this identity was taken of."""
        return (
            self.size_bytes != now.size_bytes
            or self.sample_digest != now.sample_digest
            or (self.mtime_ns is not None and self.mtime_ns != now.mtime_ns)
        )

    @classmethod
    def of(cls, path: Path) -> InputIdentity:
        stat = path.stat()
        size_bytes = stat.st_size
        digest = hashlib.blake2b(digest_size=16)
        with path.open("rb") as file:
            digest.update(file.read(_SAMPLE_BYTES))
            if size_bytes > _SAMPLE_BYTES:
                file.seek(max(size_bytes - _SAMPLE_BYTES, _SAMPLE_BYTES))
                digest.update(file.read(_SAMPLE_BYTES))
        return cls(size_bytes, digest.hexdigest(), stat.st_mtime_ns)


@dataclasses.dataclass(slots=True)
class Checkpoint:
    directory: Path
    job_id: str
    input_path: str
    input_identity: InputIdentity
    rows: int
    rows_per_item: int
    # The outputs asked for (--output-name), sorted; empty: all of the model's.
    output_names: tuple[str, ...]
    # Output name -> (dtype string, full shape); recorded when the first answer arrives.
    output_specs: dict[str, tuple[str, tuple[int, ...]]]
    done: npt.NDArray[np.bool_] = dataclasses.field(repr=False)
    arrays: dict[str, np.memmap[Any, Any]] = dataclasses.field(default_factory=dict, repr=False)
    # Output name -> its array's file in `directory`, one file per output; recorded with
    # its spec.
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    # Files of string outputs' arrays that `_resized` replaced: still the ones state.json
    # names until the next `save`, which removes them once it names the new ones.
    replaced_files: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)

    @property
    def items(self) -> int:
        return len(self.done)

    @property
    def done_rows(self) -> int:
        done_items = int(self.done.sum())
        if done_items and self.done[-1]:
            # The last item may be short.
            last_rows = self.rows - (self.items - 1) * self.rows_per_item
            return (done_items - 1) * self.rows_per_item + last_rows
        return done_items * self.rows_per_item

    def item_rows(self, item: int) -> slice:
        start = item * self.rows_per_item
        return slice(start, min(start + self.rows_per_item, self.rows))

    @classmethod
    def create(
        cls,
        directory: Path,
        *,
        job_id: str,
        input_path: Path,
        rows: int,
        rows_per_item: int,
        output_names: tuple[str, ...] = (),
    ) -> Checkpoint:
        directory.mkdir(parents=True)
        items = -(-rows // rows_per_item)
        try:
            checkpoint = cls(
                directory,
                job_id,
                str(input_path),
                InputIdentity.of(input_path),
                rows,
                rows_per_item,
                tuple(sorted(output_names)),
                {},
                np.zeros(items, dtype=np.bool_),
            )
            checkpoint.save()
        except BaseException:
            # A directory without its state (a full disk) blocked every later run: a
            # rerun was told to --resume, and --resume that state.json was unreadable.
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return checkpoint

    @classmethod
    def load(
        cls,
        directory: Path,
        *,
        input_path: Path,
        rows: int,
        rows_per_item: int,
        output_names: tuple[str, ...] = (),
        model_outputs: tuple[str, ...] = (),
    ) -> Checkpoint:
        """Opens a checkpoint, refusing it when it was made for another job or is damaged.

        `model_outputs`, when given, are the served model's output names: the checkpoint
        may hold arrays for no others. Raises CheckpointError, never another error of the
        files' making (OSError on `input_path` is the caller's).
        """
        state = _State.read(directory / "state.json")
        reasons = []
        mismatches = []
        identity = InputIdentity.of(input_path)
        if state.input_identity.differs(identity):
            if same_file(Path(state.input_path), input_path):
                reasons.append(_changed(input_path, state.input_identity, identity))
            else:
                mismatches.append(f"input file (it was made for {state.input_path})")
        if state.rows != rows:
            mismatches.append(f"rows ({state.rows} then, {rows} now)")
        if state.rows_per_item != rows_per_item:
            mismatches.append(f"--rows-per-item ({state.rows_per_item} then, {rows_per_item} now)")
        if state.output_names != tuple(sorted(output_names)):
            mismatches.append(
                f"--output-name ({', '.join(state.output_names) or 'all'} then, "
                f"{', '.join(sorted(output_names)) or 'all'} now)"
            )
        if mismatches:
            reasons.append(f"different {', '.join(mismatches)}")
        if reasons:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another job: {'; '.join(reasons)}; "
                f"expected the same input and options, or delete {directory} and run again "
                "without --resume to start over"
            )
        done = state.done_items(-(-rows // rows_per_item))
        state.check_outputs(state.output_names or model_outputs, any_done=bool(done.any()))
        checkpoint = cls(
            directory,
            state.job_id,
            state.input_path,
            state.input_identity,
            rows,
            rows_per_item,
            state.output_names,
            dict(state.outputs),
            done,
            files=dict(state.files),
        )
        for name, (dtype, shape) in state.outputs.items():
            path = checkpoint._array_path(name)
            try:
                # "r" first: "r+" would silently lengthen a short file with zeros (rows
                # marked done would read as zeros); "r" refuses it.
                np.lib.format.open_memmap(path, mode="r")
            except (OSError, ValueError) as error:
                raise CheckpointError(
                    f"checkpoint array {path} is unreadable ({error}); expected {dtype} "
                    f"{shape}. Delete {directory} to start over"
                ) from error
            try:
                array = np.lib.format.open_memmap(path, mode="r+")
            except OSError as error:  # readable, not writable: the rows done are intact
                raise CheckpointError(
                    f"checkpoint array {path} cannot be written ({error}); expected a "
                    f"checkpoint this user can write: its rows are kept, so make {directory} "
                    "writable and --resume again"
                ) from error
            # A string output's file may be another width than state.json says: a run
            # stopped between `_resized` switching files and its save (the file named
            # holds every row the state marks done either way).
            either_text = array.dtype.kind == "U" and _is_str_dtype(dtype)
            if (str(array.dtype) != dtype and not either_text) or array.shape != shape:
                raise CheckpointError(
                    f"checkpoint array {path} is {array.dtype} {array.shape}; expected "
                    f"{dtype} {shape}. Delete {directory} to start over"
                )
            checkpoint.arrays[name] = array
            checkpoint.output_specs[name] = (str(array.dtype), shape)
        return checkpoint

    def store(self, item: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Writes an item's output rows in place and marks it done (on disk at `save`).

        A string output's rows (an object array of str) are stored as `text_array` gives
        them, in an array widened first (`_resized`) where they are wider than it.

        Raises:
            CheckpointError: an output is not of the dtype or row shape the checkpoint
                holds for it, or a string ends in NUL (see `text_array`).
            OSError: an array's file cannot be made (a full disk).
        """
        rows = self.item_rows(item)
        for name, answered in outputs.items():
            values = answered
            # A decoded answer's text is an object array alone (`decode_tensor`); from
            # here on, text is a str_ array on both sides.
            if values.dtype.hasobject:
                try:
                    values = text_array(f"output {name!r} of item {item}", answered)
                except ValueError as error:
                    raise CheckpointError(
                        f"{error}; use Client.stream, which hands back each string as it came"
                    ) from error
            array = self.arrays.get(name)
            if array is None:
                array = self._new_array(name, values.dtype, (self.rows, *values.shape[1:]))
            same_type = values.dtype == array.dtype or values.dtype.kind == array.dtype.kind == "U"
            if not same_type or values.shape != array[rows].shape:
                # Written as it came, it broadcast: a model with a narrower output since
                # the job began filled each row with one value copied across it.
                raise CheckpointError(
                    f"output {name!r} of item {item} is {datatype_name(values.dtype)} "
                    f"{list(values.shape)}; the checkpoint holds {datatype_name(array.dtype)} rows "
                    f"of {list(array.shape[1:])} for it; expected the model the job began with "
                    f"(a job resumed on a changed model?), or delete {self.directory} to start "
                    "over"
                )
            if values.dtype.kind == "U" and values.itemsize > array.itemsize:
                # Checked first: a refused answer copies no file.
                array = self._resized(name, max(_chars(values.dtype), 2 * _chars(array.dtype)))
            array[rows] = values
        self.done[item] = True

    def narrow_text(self) -> None:
        """Narrows each string output's array to its widest element (`store` widens them
        by doubling); recorded at the next `save`."""
        for name, array in list(self.arrays.items()):
            if array.dtype.kind != "U" or array.size == 0:
                continue
            widest = max(int(np.strings.str_len(array).max()), 1)
            if widest < _chars(array.dtype):
                self._resized(name, widest)

    def _new_array(
        self,
        name: str,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        copy_from: npt.NDArray[Any] | None = None,
    ) -> np.memmap[Any, Any]:
        """Output `name`'s array, made in a file of its own (none of the other outputs',
        nor one `_resized` replaced), filled from `copy_from` where given, then recorded
        as the output's: stopped before (Ctrl-C during the copy), the output is still
        what it was, its file whole."""
        file = _file_for(name, [*self.files.values(), *self.replaced_files])
        path = self.directory / file
        try:
            array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
            _reserve(path)
            if copy_from is not None:
                array[...] = copy_from
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self.files[name] = file
        self.arrays[name] = array
        self.output_specs[name] = (str(dtype), shape)
        return array

    def _resized(self, name: str, chars: int) -> np.memmap[Any, Any]:
        """String output `name`'s array copied into a new file of `chars` characters per
        element (the widest element's at least), which replaces it (`_new_array`: the
        rows copied before the output's file changes); the old file is removed by the
        save that records the new one."""
        old, old_file = self.arrays[name], self.files[name]
        array = self._new_array(name, np.dtype(f"<U{chars}"), old.shape, copy_from=old)
        self.replaced_files.append(old_file)
        return array

    def save(self) -> None:
        for array in self.arrays.values():
            array.flush()  # the rows first: state.json must never claim rows not on disk
        state = {
            "version": STATE_VERSION,
            "job_id": self.job_id,
            "input_path": self.input_path,
            "input_identity": {
                key: value
                for key, value in dataclasses.asdict(self.input_identity).items()
                if value is not None  # an older client's checkpoint: no mtime_ns recorded
            },
            "rows": self.rows,
            "rows_per_item": self.rows_per_item,
            "output_names": list(self.output_names),
            "outputs": {
                name: {"dtype": dtype, "shape": list(shape), "file": self.files[name]}
                for name, (dtype, shape) in self.output_specs.items()
            },
            "done": base64.b64encode(np.packbits(self.done).tobytes()).decode("ascii"),
        }
        path = self.directory / "state.json"
        temporary = path.with_suffix(".json.tmp")
        with temporary.open("w", encoding="utf-8") as file:
            json.dump(state, file)
            file.flush()
            os.fsync(file.fileno())
        temporary.replace(path)
        # No state names them now (`_new_array` never reuses a name). Left where they
        # cannot be removed: the checkpoint's directory goes whole when the job finishes.
        for replaced in self.replaced_files:
            with contextlib.suppress(OSError):
                (self.directory / replaced).unlink(missing_ok=True)
        self.replaced_files.clear()

    def finish(self, output: Path) -> None:
        """Moves the outputs to `output` (.npy: the one output; .npz: all) and removes the
        checkpoint. Every item must be done.

        The checkpoint stays whole until `output` is: the output is staged beside the
        arrays (.npy: a hard link to the array, which stays; .npz: the archive) and
        renamed over `output`, and only then is the directory renamed away, to a fresh
        `DIR.finished-XXXX`, and removed. Interrupted (or failing: OSError, raised)
        anywhere before that rename, the checkpoint resumes with every item done and
        finishes again; after it, `output` is whole and no checkpoint is left (at worst
        part of a `DIR.finished-XXXX`, marked finished, which the next finish beside it
        removes: see `_finished_leftover`). A staged file that did not become
        `output` is removed. A fresh name, not a fixed one: a user's file or directory of
        that name was removed, or failed every finish.
        """
        assert self.done.all()
        self.narrow_text()
        self.save()
        staged = self.directory / f"{_STAGED_STEM}{output.suffix.lower()}.tmp"
        staged.unlink(missing_ok=True)  # an interrupted finish's
        self.write_output(output, link=True, staged=staged)
        self.arrays.clear()
        prefix = f"{self.directory.name}.finished-"
        for leftover in self.directory.parent.glob(f"{glob.escape(prefix)}*"):
            if _finished_leftover(leftover, prefix):  # an interrupted finish's
                _remove_finished(leftover)
        # Marked as finished before it moves: only a marked directory (or an empty one
        # of a name mkdtemp made) is ever removed as a leftover. The mark does not stop
        # a resume: a checkpoint reads its state and arrays alone.
        (self.directory / _FINISHED_MARK).touch()
        # An empty directory of a fresh name, which the rename replaces.
        finished = Path(tempfile.mkdtemp(prefix=prefix, dir=self.directory.parent))
        self.directory.replace(finished)
        _remove_finished(finished)

    def write_output(self, output: Path, *, link: bool, staged: Path | None = None) -> None:
        """Replaces `output` whole with the outputs' arrays, or leaves it as it was
        (`replace_file`, staged as `staged`): .npy holds the one output's array, .npz
        every output's (`write_npz`).

        `link`: a .npy `output` is a hard link to the array's file (`_link_or_copy`), not
        a copy: only for a checkpoint no row is written to again (`finish`), as a resume
        writes the arrays in place, through a link into `output` too.

        Raises:
            OSError: `output` cannot be written.
        """

        def make(path: Path) -> None:
            if output.suffix.lower() != ".npy":
                with path.open("wb") as file:
                    write_npz(file, self.arrays)
                return
            (name,) = self.arrays
            if link:
                _link_or_copy(self._array_path(name), path)
            else:
                with path.open("wb") as file:
                    np.lib.format.write_array(file, self.arrays[name])

        replace_file(output, make, staged)

    def _array_path(self, name: str) -> Path:
        return self.directory / self.files[name]


# Written into a checkpoint just before `finish` renames it away.
_FINISHED_MARK = ".finished"
# The checkpoint's lock file (see `locked`).
_LOCK = ".lock"


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """The checkpoint `directory` locked (flock, exclusive, on its lock file) while the
    block runs: one run at a time uses a checkpoint. Two at once (the second with
    --resume) stepped on each other: each wrote its own answers and state.json, and the
    one that finished first renamed the checkpoint away under the other. Not waited for:
    the other run may take hours. The lock goes with the process, however it ends
    (SIGKILL too), and with a `finish` that removes the checkpoint, which is done.

    Raises:
        CheckpointBusyError: another run holds it.
        CheckpointError: it cannot be opened (a checkpoint this user cannot write, or
            gone: `finish`ed by another run as this one came).
    """
    path = directory / _LOCK
    try:
        # Read-only: flock needs no write access, and a checkpoint made read-only after a
        # run (its lock file there) is refused for what it is by `load`, not here.
        lock = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise CheckpointError(
            f"cannot open the checkpoint's lock file {path} ({error}); expected a "
            f"checkpoint this user can write: make {directory} writable and run again"
        ) from error
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Locked the file, but is it still the checkpoint's? Another run's `finish` may
        # have renamed the checkpoint away between the open and the lock.
        moved = not _is_open_file(path, lock)
    except BlockingIOError as error:
        os.close(lock)
        raise CheckpointBusyError(
            f"checkpoint {directory} is in use by another run, still running (it holds "
            f"the lock {path}); expected one run per output at a time: wait for that run to "
            "end (then --resume, if it leaves rows to do) or stop it"
        ) from error
    except BaseException:
        os.close(lock)
        raise
    if moved:
        os.close(lock)
        raise CheckpointBusyError(
            f"checkpoint {directory} was finished or removed by another run as this one "
            "opened it; expected one run per output at a time: run again"
        )
    try:
        yield
    finally:
        os.close(lock)


def _is_open_file(path: Path, descriptor: int) -> bool:
    """Whether `path` names the file open as `descriptor`."""
    held = os.fstat(descriptor)
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


# `finish` stages the output in the checkpoint as output.npy.tmp (or .npz.tmp): not an
# array's name (those end in .npy), and one `_finished_leftover` knows as a checkpoint's.
_STAGED_STEM = "output"


def _finished_leftover(directory: Path, prefix: str) -> bool:
    """Whether `directory` is what an interrupted `finish` left: named by mkdtemp after
    `prefix` (eight of its letters, digits and '_'), not a link, and empty (made, not yet
    renamed onto) or marked finished and holding nothing but a checkpoint's files. A
    user's directory of another name, or unmarked, or holding anything else, stays
    (any directory of the prefix's was removed, another job's checkpoint among them)."""
    suffix = directory.name.removeprefix(prefix)
    if len(suffix) != 8 or not all(char in _MKDTEMP_CHARACTERS for char in suffix):  # noqa: PLR2004 - mkdtemp's length
        return False
    if directory.is_symlink() or not directory.is_dir():
        return False
    entries = list(directory.iterdir())
    if not entries:
        return True
    names = {entry.name for entry in entries}
    return _FINISHED_MARK in names and all(
        entry.is_file()
        and not entry.is_symlink()
        and (
            entry.name in (_FINISHED_MARK, _LOCK, "state.json")
            or entry.suffix == ".npy"
            or (entry.name.startswith(f"{_STAGED_STEM}.") and entry.suffix == ".tmp")
        )
        for entry in entries
    )


_MKDTEMP_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def _remove_finished(directory: Path) -> None:
    """Removes a finished checkpoint's files, its mark last, then the directory: cut
    short, what is left is still marked, and the next finish beside it removes it."""
    entries = sorted(directory.iterdir(), key=lambda entry: entry.name == _FINISHED_MARK)
    with contextlib.suppress(OSError):
        for entry in entries:
            entry.unlink()
        directory.rmdir()


def same_file(path: Path, other: Path) -> bool:
    """Whether `path` and `other` name one existing file (by any spelling)."""
    try:
        return path.samefile(other)
    except OSError:  # either does not exist (any more, or yet): they are not one file
        return False


def _changed(path: Path, then: InputIdentity, now: InputIdentity) -> str:
    if then.size_bytes != now.size_bytes:
        how = f"{then.size_bytes} bytes then, {now.size_bytes} now"
    elif then.sample_digest != now.sample_digest:
        how = f"the same {now.size_bytes} bytes, but the digest of its first and last MiB differs"
    else:
        assert then.mtime_ns is not None
        assert now.mtime_ns is not None
        how = (
            f"the same {now.size_bytes} bytes, but modified since: at {_when(then.mtime_ns)} "
            f"then, {_when(now.mtime_ns)} now; an edit in place, or the same rows written "
            "anew, which this client cannot tell apart without reading the whole file"
        )
    return (
        f"the input {path} changed since the checkpoint was made ({how}): the rows done "
        "may be answers to other rows"
    )


def _when(mtime_ns: int) -> str:
    """A file's modification time as a message gives it: UTC, to the microsecond."""
    moment = datetime.datetime.fromtimestamp(mtime_ns / 1e9, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds")


def replace_file(path: Path, make: Callable[[Path], object], staged: Path | None = None) -> None:
    """`path` replaced whole by the file `make` makes at `staged` (a fresh name beside
    `path` where not given), renamed over it; or left as it was, and a `staged` that did
    not become `path` removed (on Ctrl-C too). `staged` is `make`'s to create: a file
    already there is the caller's to remove first."""
    if staged is None:
        staged = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        make(staged)
        staged.replace(path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def _link_or_copy(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (no copy of the data); a copy where the file
    system has no hard links."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _reserve(path: Path) -> None:
    """Allocates the disk space of the array file `path` now: written into a sparse file
    through its memory map, a full disk killed the client with SIGBUS, no message, where
    this raises OSError (ENOSPC) that names the file. Without posix_fallocate (not Linux)
    the file stays sparse."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        return
    with path.open("r+b") as file:
        allocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)


def write_npz(file: Path | IO[bytes], arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    """Writes `arrays` as numpy.savez does (an uncompressed zip of NAME.npy members, which
    numpy.load reads), whatever their names: savez takes the arrays as keyword arguments,
    so an output named `file` failed it with a TypeError, and one named `allow_pickle`
    was taken for that option and left out of the file."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in arrays.items():
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def text_array(what: str, values: npt.NDArray[Any]) -> npt.NDArray[np.str_]:
    """A decoded string tensor (an ``object`` array of ``str``) as a numpy ``str_`` array
    as wide as its widest element (1 character at least): what .npy and .npz files hold
    without pickle, and what memory-maps. `what` names the array in a refusal.

    Raises:
        ValueError: an element ends in a NUL character, which a ``str_`` array drops
            (numpy pads its elements with NULs), or is not a ``str``.
    """
    for index, value in enumerate(values.flat):
        if not isinstance(value, str):
            raise ValueError(  # noqa: TRY004 - the caller's refusal of a value, as tensors'
                f"{what}: element {index} is {type(value).__name__}; expected str"
            )
        if value.endswith("\0"):
            raise ValueError(
                f"{what}: element {index} ends in a NUL character, which a numpy str_ array "
                "(what .npy files hold without pickle) drops"
            )
    return values.astype(str)  # as wide as its widest element, 1 character at least


def _chars(dtype: np.dtype[Any]) -> int:
    """The characters per element of a ``str_`` dtype (4 bytes each)."""
    return dtype.itemsize // np.dtype("<U1").itemsize


def _is_str_dtype(dtype: str) -> bool:
    """Whether `dtype` (from state.json) is a ``str_`` dtype. Not `is_text_dtype`: the
    checkpoint holds text as ``str_`` arrays alone (`store`), so a state.json recording
    another text dtype (object, bytes_) for a ``str_`` file is not this client's."""
    try:
        return np.dtype(dtype).kind == "U"
    except (TypeError, ValueError):
        return False


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _file_for(name: str, taken: Collection[str]) -> str:
    """A file for output `name`'s array that none of the `taken` files is, compared
    without case (a case-insensitive file system has one file for both)."""
    folded = {file.casefold() for file in taken}
    stem = _safe(name)[:_STEM_CHARS]
    if stem == name and f"{stem}.npy".casefold() not in folded:
        return f"{stem}.npy"
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    files = (f"{stem}-{digest}{f'-{n}' if n else ''}.npy" for n in itertools.count())
    return next(file for file in files if file.casefold() not in folded)


def _is_file_name(value: object) -> bool:
    """A file directly in the checkpoint's directory that can be an output's array."""
    return (
        isinstance(value, str)
        and value.endswith(".npy")
        and Path(value).name == value
        and "\\" not in value
        and "\0" not in value
    )


_MISSING: Any = object()
# What a field of state.json must be, by the words a message uses for it.
_KINDS: dict[str, Callable[[object], bool]] = {
    "a string": lambda value: isinstance(value, str),
    "an object": lambda value: isinstance(value, dict),
    "a whole number >= 1": lambda value: _is_whole(value, 1),
    "a whole number >= 0": lambda value: _is_whole(value, 0),
    "a list of strings": lambda value: (
        isinstance(value, list) and all(isinstance(part, str) for part in value)
    ),
    "a list of whole numbers >= 0": lambda value: (
        isinstance(value, list) and all(_is_whole(part, 0) for part in value)
    ),
    "a file name ending in .npy": _is_file_name,
}


def _is_whole(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclasses.dataclass(frozen=True, slots=True)
class _State:
    """state.json, checked field by field: a damaged or hand-edited file is refused with
    what was expected, never half-used."""

    path: Path
    job_id: str
    input_path: str
    input_identity: InputIdentity
    rows: int
    rows_per_item: int
    output_names: tuple[str, ...]  # sorted; empty: all of the model's
    outputs: dict[str, tuple[str, tuple[int, ...]]]
    files: dict[str, str]  # output name -> its array's file, one per output
    done: str  # base64 of the packed done bitmap; see `done_items`

    @classmethod
    def read(cls, path: Path) -> _State:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"checkpoint {path} is unreadable ({error}); delete {path.parent} to start "
                "the job over"
            ) from error
        if not isinstance(document, dict):
            raise _damaged(path, f"expected a JSON object, found {type(document).__name__}")
        version = document.get("version")
        if not _is_whole(version, 1) or version not in _READABLE_VERSIONS:
            readable = " or ".join(str(number) for number in _READABLE_VERSIONS)
            raise CheckpointError(
                f"checkpoint {path} has version {_quote(version)}; expected {readable}. "
                f"Delete {path.parent} to start the job over"
            )

        def field(parent: dict[str, Any], key: str, kind: str, where: str = "") -> Any:
            value = parent.get(key, _MISSING)
            if not _KINDS[kind](value):
                found = "missing" if value is _MISSING else _quote(value)
                raise _damaged(path, f"{where}{key} is {found}; expected {kind}")
            return value

        identity = field(document, "input_identity", "an object")
        outputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        files: dict[str, str] = {}
        for name, spec in field(document, "outputs", "an object").items():
            if not isinstance(spec, dict):
                raise _damaged(path, f"outputs[{name!r}] is {_quote(spec)}; expected an object")
            dtype = field(spec, "dtype", "a string", f"outputs[{name!r}].")
            shape = field(spec, "shape", "a list of whole numbers >= 0", f"outputs[{name!r}].")
            outputs[name] = (dtype, tuple(shape))
            if version == 1:
                files[name] = f"{_safe(name)}.npy"
            else:
                files[name] = field(
                    spec, "file", "a file name ending in .npy", f"outputs[{name!r}]."
                )
        owners: dict[str, str] = {}
        for name, file in files.items():
            other = owners.setdefault(file, name)
            if other != name:
                why = " (version 1 named each file after its output)" if version == 1 else ""
                raise _damaged(path, f"outputs {other!r} and {name!r} share the file {file}{why}")
        if "output_names" not in document:  # written before it was recorded: all outputs
            document["output_names"] = []
        return cls(
            path=path,
            job_id=field(document, "job_id", "a string"),
            input_path=field(document, "input_path", "a string"),
            input_identity=InputIdentity(
                field(identity, "size_bytes", "a whole number >= 0", "input_identity."),
                field(identity, "sample_digest", "a string", "input_identity."),
                # Not in a checkpoint of a client before it was recorded: not compared.
                None
                if "mtime_ns" not in identity
                else field(identity, "mtime_ns", "a whole number >= 0", "input_identity."),
            ),
            rows=field(document, "rows", "a whole number >= 1"),
            rows_per_item=field(document, "rows_per_item", "a whole number >= 1"),
            output_names=tuple(field(document, "output_names", "a list of strings")),
            outputs=outputs,
            files=files,
            done=field(document, "done", "a string"),
        )

    def done_items(self, items: int) -> npt.NDArray[np.bool_]:
        try:
            packed = base64.b64decode(self.done, validate=True)
        except ValueError as error:  # binascii.Error
            raise _damaged(self.path, f"done is not base64 ({error})") from error
        if len(packed) != -(-items // 8):
            raise _damaged(
                self.path,
                f"done holds {len(packed)} bytes; expected {-(-items // 8)} for {items} items",
            )
        return np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=items).astype(np.bool_)

    def check_outputs(self, wanted: tuple[str, ...], *, any_done: bool) -> None:
        """Each recorded output has the job's rows and is one of `wanted` (when known), and
        once an item is done there is an array for each of them."""
        for name, (_dtype, shape) in self.outputs.items():
            if wanted and name not in wanted:
                raise _damaged(self.path, f"it holds output {name!r}; expected only {list(wanted)}")
            if not shape or shape[0] != self.rows:
                raise _damaged(
                    self.path,
                    f"output {name!r} has shape {list(shape)}; expected {self.rows} rows",
                )
        if wanted and any_done and set(self.outputs) != set(wanted):
            raise _damaged(
                self.path,
                f"items are marked done with outputs {sorted(self.outputs)}; expected "
                f"{sorted(wanted)}",
            )


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged: {what}; delete {path.parent} to start the job over"
    )


# Longest value from the file quoted in a message.
_QUOTE_CHARS = 60


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_CHARS else f"{text[: _QUOTE_CHARS - 3]}..."
