"""Decode attention over int4 frozen blocks straight from their codes, against decode-then-attend.

A prototype outside the engine, to size what attention over the codes would save in the gathering
path: per sequence and layer, the engine decodes each frozen K and V block into fp32 (the native
codec, ``codec.native``) and the flash kernel attends the decoded rows; the prototype
(``_codes_attention.c``, compiled here with the system's C compiler into a temporary folder, since
it is no part of the install) reads the packed codes and their group parameters and returns the same
attention output. Blocks are real codec encodings (``block_codecs`` of an fp32 pool: int4, fp16
group parameters) of random K and V; the reference is the native decode plus
``scaled_dot_product_attention``; the decode alone is timed too, since that is what the codes kernel
removes (the attention itself is paid either way).

    python -m bench.micro.codes_attention --blocks 102 816 --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.micro.decode_attention import ms
from testkit.codes_attention import Blocks, build

RESULT = Path(__file__).parents[1] / "results" / "micro" / "codes_attention.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[102, 816])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lib, rows = build(), []
    cases = [Blocks(n, heads=3, group=3, dim=64) for n in args.blocks]  # SmolLM2-135M's attention
    # The references first, then the prototype: its OpenMP runtime (the system's) and PyTorch's own
    # spin after a parallel region, so interleaving them times one runtime's threads against the other's.
    for b in cases:
        rows.append({"blocks": b.n, "decode_ms": ms(b.decoded), "decode_then_attend_ms": ms(b.reference)})
    for b, row in zip(cases, rows, strict=True):
        row["codes_ms"] = ms(lambda b=b: b.from_codes(lib))
        row["max_abs_err"] = (b.from_codes(lib) - b.reference()).abs().max().item()
        print(row)
    RESULT.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
