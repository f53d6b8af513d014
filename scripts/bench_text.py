#!/usr/bin/env python3
"""What a string tensor costs the server beside numbers, measured in one run.

    .venv/bin/python scripts/bench_text.py                      # 1 000 000 strings of 2 bytes
    .venv/bin/python scripts/bench_text.py --elements 100000 --width 50 --rounds 5

Text is decoded element by element (a `str` per element, what ONNX Runtime takes), on
the server's event loop; a numeric tensor's bytes are used in place. For `--elements`
strings of `--width` ASCII bytes each, over `--rounds` rounds (the median kept):
- decode (`decode_tensor` of the STRING tensor, as the server reads a request) and
  encode (`encode_tensor` of the object array, as it writes an answer), in microseconds
  an element, and against decoding a float32 tensor of as many bytes;
- the memory the decoded request holds (tracemalloc's peak while decoding) against its
  data's bytes on the wire: what `max_message_bytes` bounds on a text model.
README's string paragraph quotes these figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

from laneserve.client.tensors import decode_tensor, encode_tensor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--elements", type=int, default=1_000_000, help="default: %(default)s")
    parser.add_argument(
        "--width", type=int, default=2, help="bytes a string (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.elements < 1 or args.width < 0 or args.rounds < 1:
        parser.error("expected --elements >= 1, --width >= 0 and --rounds >= 1")

    # Distinct texts (digits, padded): CPython shares one object for "" and for each
    # one-character string, which would hide the cost of a str per element.
    texts = np.array(
        [
            f"{index:0{args.width}d}"[-args.width :] if args.width else ""
            for index in range(args.elements)
        ],
        dtype=object,
    )
    tensor = encode_tensor("text", texts)
    numbers = encode_tensor("numbers", np.zeros(max(len(tensor.data) // 4, 1), np.float32))

    decode_s, encode_s, numeric_s = [], [], []
    for _ in range(args.rounds):
        started = time.perf_counter()
        decoded = decode_tensor(tensor)
        decode_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        encode_tensor("text", decoded)
        encode_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        decode_tensor(numbers)
        numeric_s.append(time.perf_counter() - started)
        del decoded

    tracemalloc.start()
    held = decode_tensor(tensor)
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del held

    per_element_us = 1e6 / args.elements
    decode, encode, numeric = map(statistics.median, (decode_s, encode_s, numeric_s))
    data_bytes = len(tensor.data)
    print(f"{args.elements} strings of {args.width} bytes: {data_bytes} bytes of data")
    print("| measure | figure |")
    print("|---|---|")
    print(f"| decode, us an element | {decode * per_element_us:.3f} |")
    print(f"| encode, us an element | {encode * per_element_us:.3f} |")
    print(f"| decode, text / float32 of as many bytes | {decode / max(numeric, 1e-9):.0f}x |")
    print(f"| memory held decoded / data bytes | {peak_bytes / data_bytes:.1f}x |")


if __name__ == "__main__":
    main()
