"""The bulk job's checkpoint: which items are done, and their outputs, on disk.

Layout, beside the output file ``OUT``::

    OUT.partial/state.json      job id, input identity, rows per item, done bitmap
    OUT.partial/<output>.npy    one memory-mapped array per model output, rows in place

Invariant: an item marked done in ``state.json`` has its output rows on disk. `save`
flushes the arrays before it replaces ``state.json`` (written to a temporary file,
fsynced, then renamed), so a job killed at any moment resumes from a consistent state;
at worst the items answered since the last save are asked for again, and the server's
idempotency by request_id answers them without running them twice (same job id).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Checkpoint", "CheckpointError", "InputIdentity"]

STATE_VERSION = 1
_SAMPLE_BYTES = 1 << 20


class CheckpointError(ValueError):
    """The checkpoint cannot be used for this job; the message says why and what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class InputIdentity:
    """Enough to tell a different input file from the one a checkpoint was made for.

    Size plus a digest of the first and last MiB: cheap on files of many GiB, and it
    catches a wrong or regenerated file; it is not a guard against deliberate edits.
    """

    size_bytes: int
    sample_digest: str

    @classmethod
    def of(cls, path: Path) -> InputIdentity:
        size_bytes = path.stat().st_size
        digest = hashlib.blake2b(digest_size=16)
        with path.open("rb") as file:
            digest.update(file.read(_SAMPLE_BYTES))
            if size_bytes > _SAMPLE_BYTES:
                file.seek(max(size_bytes - _SAMPLE_BYTES, _SAMPLE_BYTES))
                digest.update(file.read(_SAMPLE_BYTES))
        return cls(size_bytes, digest.hexdigest())


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
    ) -> Checkpoint:
        """Opens a checkpoint, refusing it when it was made for another job."""
        state_path = directory / "state.json"
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"checkpoint {state_path} is unreadable ({error}); delete {directory} to "
                "start the job over"
            ) from error
        if state.get("version") != STATE_VERSION:
            raise CheckpointError(
                f"checkpoint {state_path} has version {state.get('version')!r}; expected "
                f"{STATE_VERSION}. Delete {directory} to start the job over"
            )
        identity = InputIdentity(**state["input_identity"])
        mismatches = []
        if identity != InputIdentity.of(input_path):
            mismatches.append(f"input file (it was made for {state['input_path']})")
        if state["rows"] != rows:
            mismatches.append(f"rows ({state['rows']} then, {rows} now)")
        if state["rows_per_item"] != rows_per_item:
            mismatches.append(
                f"--rows-per-item ({state['rows_per_item']} then, {rows_per_item} now)"
            )
        then_names = tuple(state.get("output_names", ()))  # absent before it was recorded
        if then_names != tuple(sorted(output_names)):
            mismatches.append(
                f"--output-name ({', '.join(then_names) or 'all'} then, "
                f"{', '.join(sorted(output_names)) or 'all'} now)"
            )
        if mismatches:
            raise CheckpointError(
                f"checkpoint {directory} belongs to another job: different "
                f"{', '.join(mismatches)}; expected the same input and options, or delete "
                f"{directory} to start over"
            )
        items = -(-rows // rows_per_item)
        done = np.unpackbits(
            np.frombuffer(base64.b64decode(state["done"]), dtype=np.uint8), count=items
        ).astype(np.bool_)
        specs = {
            name: (spec["dtype"], tuple(spec["shape"])) for name, spec in state["outputs"].items()
        }
        checkpoint = cls(
            directory,
            state["job_id"],
            state["input_path"],
            identity,
            rows,
            rows_per_item,
            then_names,
            specs,
            done,
        )
        for name, (dtype, shape) in specs.items():
            array = np.lib.format.open_memmap(checkpoint._array_path(name), mode="r+")
            if str(array.dtype) != dtype or array.shape != shape:
                raise CheckpointError(
                    f"checkpoint array {checkpoint._array_path(name)} is {array.dtype} "
                    f"{array.shape}; expected {dtype} {shape}. Delete {directory} to start over"
                )
            checkpoint.arrays[name] = array
        return checkpoint

    def store(self, item: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Writes an item's output rows in place and marks it done (on disk at `save`)."""
        rows = self.item_rows(item)
        for name, values in outputs.items():
            array = self.arrays.get(name)
            if array is None:
                shape = (self.rows, *values.shape[1:])
                array = np.lib.format.open_memmap(
                    self._array_path(name), mode="w+", dtype=values.dtype, shape=shape
                )
                self.arrays[name] = array
                self.output_specs[name] = (str(values.dtype), shape)
            array[rows] = values
        self.done[item] = True

    def save(self) -> None:
        for array in self.arrays.values():
            array.flush()  # the rows first: state.json must never claim rows not on disk
        state = {
            "version": STATE_VERSION,
            "job_id": self.job_id,
            "input_path": self.input_path,
            "input_identity": dataclasses.asdict(self.input_identity),
            "rows": self.rows,
            "rows_per_item": self.rows_per_item,
            "output_names": list(self.output_names),
            "outputs": {
                name: {"dtype": dtype, "shape": list(shape)}
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

    def finish(self, output: Path) -> None:
        """Moves the outputs to `output` (.npy: the one output; .npz: all) and removes the
        checkpoint. Every item must be done."""
        assert self.done.all()
        self.save()
        if output.suffix == ".npy":
            (name,) = self.arrays
            self.arrays[name].flush()
            self.arrays.clear()
            self._array_path(name).replace(output)
        else:
            # numpy's stub matches **arrays against `allow_pickle: bool` as well.
            np.savez(output, **self.arrays)  # type: ignore[arg-type]
            self.arrays.clear()
        shutil.rmtree(self.directory)

    def _array_path(self, name: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.directory / f"{safe}.npy"
