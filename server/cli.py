"""`laneserve` command line: `serve` a model, `make-model` to build the demo model."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from laneserve.server.app import LaneServer, load_engine
from laneserve.server.config import DEVICES, ConfigError, ServerConfig, load_config
from laneserve.server.engine import EngineStartError

log = logging.getLogger("laneserve")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "make-model":
        from laneserve.server.demo_model import make_demo_model  # noqa: PLC0415 - needs onnx

        make_demo_model(args.path, seed=args.seed)
        print(f"wrote {args.path}")
        return 0
    try:
        config = load_config(
            args.config,
            model_path=args.model,
            overrides={
                "host": args.host,
                "port": args.port,
                "max_batch_size": args.max_batch_size,
                "device": args.device,
                "drain_grace_s": args.drain_grace_s,
                "max_message_bytes": args.max_message_bytes,
                "intra_op_threads": args.intra_op_threads,
            },
        )
        return asyncio.run(_serve(config))
    except (ConfigError, EngineStartError, OSError) as error:
        print(f"laneserve: {error}", file=sys.stderr)
        return 2


async def _serve(config: ServerConfig) -> int:
    server = LaneServer(load_engine(config), config)
    await server.start()
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        if not stopping:
            log.info(
                "%s: draining (grace %.1fs)", signal.Signals(signum).name, config.drain_grace_s
            )
            stopping.append(loop.create_task(server.stop()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.wait_stopped()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laneserve", description=__doc__)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an ONNX model over gRPC")
    serve.add_argument("--model", required=True, help="path of the ONNX model")
    serve.add_argument("--config", help="TOML file with [server] settings and [[lanes]]")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 50051; 0 = any)")
    serve.add_argument("--max-batch-size", type=int, help="upper bound of rows per batch")
    serve.add_argument("--device", choices=DEVICES, help="execution device (default auto)")
    serve.add_argument(
        "--drain-grace-s", type=float, help="seconds queued work may finish on SIGTERM"
    )
    serve.add_argument("--max-message-bytes", type=int, help="gRPC message size limit")
    serve.add_argument("--intra-op-threads", type=int, help="ONNX Runtime threads (0 = auto)")
    make = commands.add_parser("make-model", help="write the demo MLP model")
    make.add_argument("path")
    make.add_argument("--seed", type=int, default=0)
    return parser


if __name__ == "__main__":
    sys.exit(main())
