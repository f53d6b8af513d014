"""The memory checks a server makes once its model is loaded and probed, before it
serves: the gauge that reads memory in use (`device_gauge`: the GPU's, NVML, or the
process's), the admission watermark from the config, the device or the cgroup
(`make_watermark`), an idle server at or above its low mark refused, naming the
setting that could hold it, or under the cgroup's limit warned and served without a
watermark (`watch_memory`); warnings where the server's own full batch or arena would
close lanes, and where a fixed --batch-cap is at or above a size the probe ran out of
memory at (`warn_if_the_fixed_cap_exceeds_the_fit`). Apart from memory (the watermark,
gauges and estimates themselves, used throughout serving): these are the start's
judgments of one configuration against one idle reading, each with its message. Apart
from app: a change to a memory refusal or warning at start belongs here, not beside
the ports and the drain."""

from __future__ import annotations

import logging
from typing import NoReturn

from laneserve.server.config import DEFAULT_MEMORY_LOW_WATERMARK, ConfigError, ServerConfig
from laneserve.server.engine import Engine
from laneserve.server.log_events import log_event
from laneserve.server.memory import (
    CgroupMemoryLimit,
    MemoryGauge,
    NvmlUnavailableError,
    ProcessRssGauge,
    Watermark,
    cgroup_memory_limit,
    format_bytes,
    format_bytes_beyond,
    parse_memory_limit,
    release_free_heap,
    session_gpu_id,
    share_above,
)
from laneserve.server.probe import Probe
from laneserve.server.providers import CUDA, nvml_start_error, open_nvml_gauge

log = logging.getLogger(__name__)


def on_gpu(engine: Engine) -> bool:
    """Whether the session runs on CUDA (the runtime may have built it on the CPU)."""
    return engine.providers[0] == CUDA


def device_gauge(engine: Engine, watermark: Watermark | None = None) -> MemoryGauge:
    """Memory in use where the session allocates: the GPU's (NVML) or this process's
    (fed to `watermark`, it gives back the free heap first when that decides: see
    ProcessRssGauge)."""
    return open_nvml_gauge() if on_gpu(engine) else ProcessRssGauge(watermark)


def _watermark_limit_name(engine: Engine) -> str:
    """What the watermark's marks are fractions of, as messages name it."""
    if on_gpu(engine):
        return f"the memory of GPU {session_gpu_id()!r}"
    return "server.host_memory_limit"


def _watermark_reading(engine: Engine) -> str:
    """What the watermark's readings measure (`device_gauge`), as messages name it."""
    if on_gpu(engine):
        return f"memory in use on GPU {session_gpu_id()!r}"
    return "this process's resident memory"


def make_watermark(
    config: ServerConfig,
    engine: Engine,
    device_total_bytes: int | None,
    cgroup: CgroupMemoryLimit | None,
) -> Watermark | None:
    """The admission watermark, where there is a limit to watch: on a GPU the device's
    total memory (`device_total_bytes`, NVML's), on the CPU host_memory_limit (resident
    memory), or where that is unset the least memory limit of the process's cgroups
    (`cgroup`, read by the caller: its warnings name the file), as logged (a
    container's: past it the OOM killer ends the server, and with no watermark queued
    request bodies took a 512 MiB pod's server from 95 to 761 MiB, none refused).
    Neither is the arena's budget (memory_limit): NVML reads the whole device, every
    process's use and the CUDA context beside the arena, so marks taken from the
    budget closed lanes at the server's own full batch (an 80 GiB GPU: the arena at its
    72 GiB cap, and the context, read 72.6 GiB, above a high mark of 68.4). On a GPU
    queued inputs wait in host memory and the arena is capped by the runtime: what
    presses the device is the device filling up as a whole."""
    if on_gpu(engine):
        limit_bytes = device_total_bytes
    elif config.host_memory_limit is not None:
        limit_bytes = parse_memory_limit(config.host_memory_limit).resolve(None)
    elif cgroup is not None:
        limit_bytes = cgroup.limit_bytes
        log_event(
            log,
            logging.INFO,
            "host_memory_limit_from_cgroup",
            f"server.host_memory_limit unset: the host memory watermarks are fractions of "
            f"the cgroup memory limit, {format_bytes(limit_bytes)} ({cgroup.source}); "
            "--host-memory-limit overrides it",
            host_memory_limit_bytes=limit_bytes,
            source=cgroup.source,
        )
    else:
        limit_bytes = None
    if limit_bytes is None:
        return None
    high_bytes = int(limit_bytes * config.memory_high_watermark)
    low_bytes = int(limit_bytes * config.memory_low_watermark)
    if low_bytes == 0:  # a mark of 0 bytes; the high mark is never below the low one
        keys, marks = "server.memory_low_watermark", f"{config.memory_low_watermark:g} is"
        if high_bytes == 0:
            keys += ", server.memory_high_watermark"
            marks = f"{config.memory_low_watermark:g} and {config.memory_high_watermark:g} are"
        raise ConfigError(
            f"{keys}: {marks} 0 bytes of {_watermark_limit_name(engine)} "
            f"({format_bytes(limit_bytes)}); expected a fraction of the limit above what the "
            f"server holds idle (the default low watermark is {DEFAULT_MEMORY_LOW_WATERMARK})"
        )
    return Watermark(
        lanes=len(config.lanes),
        high_bytes=high_bytes,
        low_bytes=low_bytes,
        limit_bytes=limit_bytes,
        reading=_watermark_reading(engine),
    )


# What a server needs above its idle reading; the low mark must leave it.
_ROOM = "with room above it for what serving keeps in use (buffers and caches a burst leaves)"


def _check_idle_memory(
    config: ServerConfig,
    engine: Engine,
    watermark: Watermark,
    used_bytes: int | None,
    probe: Probe,
) -> None:
    """Refuses a start whose idle reading is at or above the low mark: a lane the
    watermark closes reopens only below it, so it would stay closed with nothing queued
    or running. `probe`: the start-up probe, whose fitted readings tell what a full
    batch keeps in use."""
    if used_bytes is None or used_bytes < watermark.low_bytes:
        return
    if on_gpu(engine):
        _refuse_full_gpu(config, watermark, used_bytes)
    else:
        _refuse_host_limit(config, watermark, used_bytes, probe)


def _marks_expected(config: ServerConfig, share: float) -> tuple[str, str]:
    """The watermark keys at fault where the server needs `share` of the limit below its
    low mark (`share_above`'s), and what they are expected to be: the low mark above the
    share, the high one too where the low mark above it would be above the high one (the
    config refuses that)."""
    keys = "server.memory_low_watermark"
    expected = f"memory_low_watermark above {share:g}"
    if share > config.memory_high_watermark:
        keys += ", server.memory_high_watermark"
        expected += " and memory_high_watermark at least as high"
    return keys, expected


def _refuse_full_gpu(config: ServerConfig, watermark: Watermark, used_bytes: int) -> NoReturn:
    """On a GPU the reading is every process's use of the device, this server's context
    and weights among it, against the device's total: no setting of laneserve's holds
    it lower (memory_limit caps the arena, not the device), so the GPU is named with what
    it holds, and the marks as the setting that could still move."""
    keys, expected = _marks_expected(config, share_above(used_bytes, watermark.limit_bytes))
    raise ConfigError(
        f"{keys}: GPU {session_gpu_id()!r} has {format_bytes(used_bytes)} of its "
        f"{format_bytes(watermark.limit_bytes)} in use with the server idle after loading "
        "the model (every process's use, this server's among it), at or above the low "
        f"watermark {format_bytes(watermark.low_bytes)} (memory_low_watermark "
        f"{config.memory_low_watermark:g} of the GPU's memory), so lanes closed by memory "
        "pressure could never reopen; expected a GPU with more free memory, or "
        f"{expected} (the share of the GPU's memory in use idle; the default low watermark "
        f"is {DEFAULT_MEMORY_LOW_WATERMARK}), {_ROOM}"
    )


def _refuse_host_limit(
    config: ServerConfig, watermark: Watermark, used_bytes: int, probe: Probe
) -> NoReturn:
    """On the CPU the limit it names is a floor: the idle reading plus what a full batch
    keeps in use (`_full_batch_bytes`: the probe's fitted bytes per row times the cap),
    over the low mark. Named from the idle reading alone, it let a server start whose
    lanes all stayed closed after one burst: for 272 MiB of weights and 512-row batches
    ~426 MiB was named, and under 440 MiB the server held 431 MiB with nothing running,
    62 MiB above idle, against a low mark of 374 MiB. The probe measured 33 MiB for that
    batch: what a burst keeps beyond it (queued requests, gRPC's buffers, the heap) is
    the room the message asks for. Where the limit holds the idle server below the
    default low mark, the low mark set lower is what fails, and is named instead, above
    the same sum's share of the limit: above the idle reading's alone (0.581 of 200 MiB
    for the demo model with 4 096-row batches), lanes a burst closed stayed closed. A low
    mark of 1e-9 asked for a limit above 100 PiB. Where that share reaches the whole
    limit no mark can hold it, and the limit is named after all."""
    held = (
        f"the server holds {format_bytes(used_bytes)} idle after loading the model, at or "
        f"above the low watermark {format_bytes(watermark.low_bytes)} (memory_low_watermark "
        f"{config.memory_low_watermark:g} of {format_bytes(watermark.limit_bytes)}), so lanes "
        "closed by memory pressure could never reopen"
    )
    batch_bytes = _full_batch_bytes(probe)
    share = share_above(used_bytes + batch_bytes, watermark.limit_bytes)
    if used_bytes < int(watermark.limit_bytes * DEFAULT_MEMORY_LOW_WATERMARK) and share < 1:
        keys, expected = _marks_expected(config, share)
        counted = f" plus {_a_full_batch(probe, batch_bytes)}" if batch_bytes else ""
        raise ConfigError(
            f"{keys}: {held}; expected {expected} (the share of server.host_memory_limit the "
            f"server holds idle{counted}; the default low watermark is "
            f"{DEFAULT_MEMORY_LOW_WATERMARK}), {_ROOM}"
        )
    counted = (
        f" (the idle reading plus {_a_full_batch(probe, batch_bytes)}, over "
        f"memory_low_watermark {config.memory_low_watermark:g})"
        if batch_bytes
        else ""
    )
    floor_bytes = _host_limit_floor(config, used_bytes, batch_bytes)
    # Keyed: `serve` names --host-memory-limit where the flag gave it, the key where the
    # file did.
    raise ConfigError(
        f"{held}; expected a limit above {format_bytes_beyond(floor_bytes, above=True)}"
        f"{counted}, {_ROOM}",
        key="server.host_memory_limit",
    )


def _a_full_batch(probe: Probe, batch_bytes: int) -> str:
    """A full batch (`batch_bytes`, `_full_batch_bytes`'s, not 0) as messages name it."""
    return (
        f"a full batch of {probe.batch_cap} rows at "
        f"{format_bytes(batch_bytes // probe.batch_cap)} a row as the probe measured, "
        f"{format_bytes(batch_bytes)}"
    )


def _host_limit_floor(config: ServerConfig, used_bytes: int, batch_bytes: int) -> int:
    """The least host_memory_limit whose low mark lies above the idle reading plus a
    full batch: lanes a burst of full batches closes can reopen below it."""
    return int((used_bytes + batch_bytes) / config.memory_low_watermark)


def _full_batch_bytes(probe: Probe) -> int:
    """What a full batch keeps in use above the idle reading, as the probe measured it:
    its fitted bytes per row times the batch cap; 0 where memory in use could not be
    fitted (fewer than two sizes read)."""
    fit = probe.memory_fit
    return 0 if fit is None else fit.per_row_bytes * probe.batch_cap


def _warn_if_a_full_arena_closes_lanes(
    config: ServerConfig,
    engine: Engine,
    watermark: Watermark,
    used_bytes: int | None,
    weights_bytes: int,
) -> None:
    """On a GPU, warns where a batch that fills the arena would take the device to the
    high mark by itself: lanes would close at the server's own work, and reopen only
    once the arena gave its regions back. Not refused: a model whose batches never fill
    the arena (most small ones) never gets there.

    The device at a full arena is read as the idle reading plus the arena's whole cap
    less the weights (`weights_bytes`, the static estimate's: the arena holds them idle,
    so the idle reading has them already), not the probe's fitted readings: those
    predict a full batch of the probe's own rows, while rows of another width, or
    regions the arena keeps from batches of several sizes, fill it to its cap all the
    same. Where the estimate failed (0) the weights count twice: it errs toward warning
    by their size."""
    arena_bytes = engine.memory_limit_bytes
    if arena_bytes is None or used_bytes is None:
        return
    in_both_bytes = min(weights_bytes, arena_bytes)
    full_bytes = used_bytes + arena_bytes - in_both_bytes
    if full_bytes < watermark.high_bytes:
        return
    # Below the high mark less the idle reading, the weights given back (positive: the
    # idle check passed, so the reading is below the low mark, at most the high one).
    limit_below_bytes = watermark.high_bytes - used_bytes + in_both_bytes
    remedy = f"--memory-limit below {format_bytes_beyond(limit_below_bytes, above=False)}"
    remedy += _or_a_high_mark_above(full_bytes, watermark)
    gpu = session_gpu_id()
    log_event(
        log,
        logging.WARNING,
        "watermark_below_full_arena",
        f"GPU {gpu!r}: {format_bytes(used_bytes)} of {format_bytes(watermark.limit_bytes)} "
        "is in use with the server idle (every process's use), and the session's arena may "
        f"grow to its memory_limit of {format_bytes(arena_bytes)}: together (its weights "
        f"counted once) "
        f"{format_bytes(full_bytes)}, at or above the high watermark "
        f"{format_bytes(watermark.high_bytes)} (memory_high_watermark "
        f"{config.memory_high_watermark:g} of the GPU's memory), so a batch that fills the "
        "arena would close lanes by itself, until the arena gives its regions back; "
        f"expected {remedy}",
        gpu=gpu,
        used_bytes=used_bytes,
        memory_limit_bytes=arena_bytes,
        full_arena_bytes=full_bytes,
        high_watermark_bytes=watermark.high_bytes,
        total_bytes=watermark.limit_bytes,
        memory_limit_below_bytes=limit_below_bytes,
    )


def _warn_if_a_full_batch_closes_lanes(
    config: ServerConfig,
    watermark: Watermark,
    used_bytes: int | None,
    probe: Probe,
    cgroup_source: str | None,
) -> None:
    """On the CPU, warns where the idle reading plus a full batch as the probe measured
    it (`_full_batch_bytes`) reaches the high mark: the server's own batches would close
    lanes, and they reopen only below the low mark, which what a burst keeps may hold
    them above (the demo model with 4 096-row batches under a 140 MiB limit: 120 MiB
    idle, 137 MiB with every lane closed 10 s after one burst, against a low mark of
    119). Not refused, as on a GPU: a server whose requests never fill a batch never
    gets there, and limits like 150 MiB serve the demo model's small batches.

    Its own event, beside the GPU's watermark_below_full_arena: what fills is a batch
    the probe measured, not an arena at its cap, and the limit the remedy raises is
    host_memory_limit (or the container's), not the arena's memory_limit. The limit
    named is the floor a refused start names (the sum over the low mark, not the high
    one): above it lanes a burst closes can reopen as well. `cgroup_source`: the file
    the limit was read from where the cgroup's stands in for an unset host_memory_limit
    (None: the setting's). Then the limit to raise is the container's: the warning had
    named a --host-memory-limit never set, and one above the container's limit lets the
    OOM killer come before the watermark acts."""
    if used_bytes is None:
        return
    batch_bytes = _full_batch_bytes(probe)
    full_bytes = used_bytes + batch_bytes
    if full_bytes < watermark.high_bytes:
        return
    floor_bytes = _host_limit_floor(config, used_bytes, batch_bytes)
    limit = format_bytes(watermark.limit_bytes)
    limit_named, raised = f"server.host_memory_limit {limit}", "--host-memory-limit"
    source: dict[str, str] = {}
    if cgroup_source is not None:
        limit_named = (
            f"the cgroup memory limit {limit} ({cgroup_source}; server.host_memory_limit unset)"
        )
        raised, source = "a container memory limit", {"source": cgroup_source}
    remedy = f"{raised} above {format_bytes_beyond(floor_bytes, above=True)}"
    remedy += (
        f" (the idle reading plus the batch, over memory_low_watermark "
        f"{config.memory_low_watermark:g}), {_ROOM}"
    )
    log_event(
        log,
        logging.WARNING,
        "watermark_below_full_batch",
        f"the server holds {format_bytes(used_bytes)} idle of {limit_named}; with "
        f"{_a_full_batch(probe, batch_bytes)}, it holds "
        f"{format_bytes(full_bytes)}, at or above the high watermark "
        f"{format_bytes(watermark.high_bytes)} (memory_high_watermark "
        f"{config.memory_high_watermark:g} of {limit}), so a full batch would close lanes "
        "by itself, and they reopen only below the low watermark "
        f"{format_bytes(watermark.low_bytes)}; expected {remedy}"
        f"{_or_a_high_mark_above(full_bytes, watermark)}",
        used_bytes=used_bytes,
        batch_cap=probe.batch_cap,
        batch_bytes=batch_bytes,
        full_batch_bytes=full_bytes,
        high_watermark_bytes=watermark.high_bytes,
        low_watermark_bytes=watermark.low_bytes,
        host_memory_limit_bytes=watermark.limit_bytes,
        host_memory_limit_above_bytes=floor_bytes,
        **source,
    )


def _or_a_high_mark_above(full_bytes: int, watermark: Watermark) -> str:
    """The high mark that leaves `full_bytes` below it, as a warning's second remedy;
    "" where rounded up it reaches the whole limit: the config refuses marks above 1,
    and a mark of 1 would keep lanes open until the memory is gone."""
    share = share_above(full_bytes, watermark.limit_bytes)
    return "" if share >= 1 else f" or server.memory_high_watermark above {share:g}"


def _watermark_and_gauge(
    config: ServerConfig,
    engine: Engine,
    memory_gauge: MemoryGauge | None,
    cgroup: CgroupMemoryLimit | None,
) -> tuple[Watermark | None, MemoryGauge]:
    """The watermark, where there is a limit to watch, and its reading (`memory_gauge`,
    else the device's). On a GPU the gauge comes first, its total being the watermark's
    limit; on the CPU the watermark does, the process's gauge taking it."""
    if on_gpu(engine):
        gauge = memory_gauge or device_gauge(engine)
        return make_watermark(config, engine, gauge.total_bytes(), None), gauge
    watermark = make_watermark(config, engine, None, cgroup)
    return watermark, memory_gauge or device_gauge(engine, watermark)


def watch_memory(
    config: ServerConfig,
    engine: Engine,
    memory_gauge: MemoryGauge | None,
    weights_bytes: int,
    probe: Probe,
) -> tuple[Watermark | None, MemoryGauge | None]:
    """The watermark, where there is a limit to watch, and its reading (`memory_gauge`,
    else the device's), once the idle server is seen to fit below its low mark
    (ConfigError otherwise). `weights_bytes`: the model's weights, as far as known (0).
    `probe`: the start-up probe's findings. Under a limit taken from the cgroup
    (host_memory_limit unset) an idle reading at or above the low mark is no refusal:
    the server serves as it did without a limit, with no watermark, and says so (a
    default must not refuse a start that serves, a container sized for the model but
    not for the default marks)."""
    from_cgroup = not on_gpu(engine) and config.host_memory_limit is None
    # Read once: the watermark's limit, and the file the warnings below name.
    cgroup = cgroup_memory_limit() if from_cgroup else None
    try:
        watermark, gauge = _watermark_and_gauge(config, engine, memory_gauge, cgroup)
        if watermark is None:
            return None, None
        # Read as an idle running server reads itself once lanes close: the arena's
        # regions given back (`release_idle_memory`) and the C library's free heap. Read
        # with the largest probe batch's regions still held, a start with max_batch_size
        # 2048 and a 200 MiB host limit was refused at 187 MiB, though idle it held 123.
        engine.release_idle_memory()
        release_free_heap()
        used_bytes = gauge.used_bytes()
    except NvmlUnavailableError as error:
        raise nvml_start_error(error) from error
    if from_cgroup and used_bytes is not None and used_bytes >= watermark.low_bytes:
        limit = format_bytes(watermark.limit_bytes)
        log_event(
            log,
            logging.WARNING,
            "host_watermark_off",
            f"the server holds {format_bytes(used_bytes)} idle after loading the model, at "
            f"or above the low watermark {format_bytes(watermark.low_bytes)} "
            f"(memory_low_watermark {config.memory_low_watermark:g} of the cgroup memory "
            f"limit {limit}), so lanes closed by memory pressure could never reopen: serving "
            "without a host memory watermark, queued requests bounded by the lanes alone; "
            "expected a cgroup memory limit with room above the idle server, or "
            "--host-memory-limit set (a start it cannot hold is refused, naming one that can)",
            used_bytes=used_bytes,
            low_watermark_bytes=watermark.low_bytes,
            host_memory_limit_bytes=watermark.limit_bytes,
        )
        return None, None
    _check_idle_memory(config, engine, watermark, used_bytes, probe)
    if on_gpu(engine):
        _warn_if_a_full_arena_closes_lanes(config, engine, watermark, used_bytes, weights_bytes)
    else:
        source = None if cgroup is None else cgroup.source
        _warn_if_a_full_batch_closes_lanes(config, watermark, used_bytes, probe, source)
    return watermark, gauge


def warn_if_the_fixed_cap_exceeds_the_fit(config: ServerConfig, probe: Probe) -> None:
    """A fixed cap (--batch-cap) at or above a size the probe saw run out of memory: the
    probe line said so at INFO only, and the first full batch then ran out of memory,
    split and lowered the cap, seconds into serving, with no WARNING before it."""
    fails = probe.first_failing_rows
    if config.batch_cap is None or fails is None or config.batch_cap < fails:
        return
    fitted = max(probe.run_s)  # the largest size that ran (the probe runs one at least)
    log_event(
        log,
        logging.WARNING,
        "batch_cap_exceeds_fit",
        f"--batch-cap {config.batch_cap} is above what fits: the probe ran out of memory at "
        f"{fails} rows ({fitted} ran). The first batch too large to fit will run out of "
        "memory, be split in halves and retried, and lower the cap, which then learns back "
        f"up; set --batch-cap below {fails}, or leave it out for the probe to find the cap",
        batch_cap=config.batch_cap,
        first_failing_rows=fails,
        largest_fitting_rows=fitted,
    )
