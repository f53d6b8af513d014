"""Writes the laneserve demo model (a seeded MLP) to an ONNX file.

.venv/bin/python scripts/make_model.py models/demo.onnx --hidden-dim 1024
.venv/bin/python scripts/make_model.py models/text.onnx --text   # string tensors
"""

import argparse

from laneserve.server.demo_model import make_demo_model, make_text_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", help="where to write the .onnx file (folders are created)")
    parser.add_argument("--input-dim", type=int, default=512, help="default: %(default)s")
    parser.add_argument("--hidden-dim", type=int, default=2048, help="default: %(default)s")
    parser.add_argument("--hidden-layers", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--output-dim", type=int, default=10, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--text",
        action="store_true",
        help="write the text model instead (string inputs and outputs; the sizes and seed "
        "do not apply)",
    )
    args = parser.parse_args(argv)
    if args.text:
        make_text_model(args.path)
        return
    try:
        make_demo_model(
            args.path,
            input_dim=args.input_dim,
            hidden_dim=args.hidden_dim,
            hidden_layers=args.hidden_layers,
            output_dim=args.output_dim,
            seed=args.seed,
        )
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
