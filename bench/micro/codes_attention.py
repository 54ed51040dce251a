"""Decode attention over frozen blocks straight from their codes, against decode-then-attend.

What ``attention.codes`` saves per sequence and layer: the gathering path decoded each frozen K and V
block (the native codec, ``codec.native.decode_into``) and the flash kernel attended the decoded rows;
``codec.native.attend_codes`` reads the packed codes and their group parameters and folds the same
attention into a running (max, sum, accumulator). Blocks are real codec encodings (``block_codecs``)
of random K and V, SmolLM2-135M's attention shape (3 KV heads, 3 queries each, head_dim 64), int4;
``--pool`` picks the pool the codecs are chosen for (fp32: fp16 key parameters; bf16: dq6). The
decode alone is timed too, since that is what reading the codes removes, and the library's two forms
of the fold for this shape side by side: ``codes_ms`` the one it runs here (AVX2 vectors on x86-64-v3
CPUs), ``codes_arrays_ms`` the portable array form.

    python -m bench.micro.codes_attention --blocks 102 816 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.micro.decode_attention import ms
from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import decode_rows, encode_rows

RESULT = Path(__file__).parents[1] / "results" / "micro" / "codes_attention.json"
BS, HEADS, GROUP, DIM = 16, 3, 3, 64


def case(n: int, bits: int, element_bytes: int) -> dict:
    k_spec, v_spec = block_codecs(BS, HEADS, DIM, bits, DIM, element_bytes=element_bytes)
    k_rows = encode_rows(torch.randn(n, BS, HEADS, DIM), k_spec)
    v_rows = encode_rows(torch.randn(n, BS, HEADS, DIM), v_spec)
    q = torch.randn(1, HEADS * GROUP, DIM)
    qs = (q / math.sqrt(DIM)).contiguous()
    row_start, valid = torch.tensor([0, n]), torch.full((n,), BS, dtype=torch.int32)

    def decoded() -> tuple[torch.Tensor, torch.Tensor]:
        return decode_rows(k_rows, k_spec), decode_rows(v_rows, v_spec)

    def reference() -> torch.Tensor:
        k, v = (x.view(n * BS, HEADS, DIM).transpose(0, 1)[None] for x in decoded())
        return F.scaled_dot_product_attention(q.view(1, HEADS, GROUP, DIM), k, v).reshape(1, -1, DIM)

    def from_codes() -> torch.Tensor:
        state = (torch.full((1, HEADS * GROUP), -math.inf), torch.zeros(1, HEADS * GROUP),
                 torch.zeros(1, HEADS * GROUP, DIM))
        native.attend_codes(qs, native.row_bytes(k_rows), k_spec, native.row_bytes(v_rows), v_spec, row_start,
                            valid, state)
        return state[2] / state[1][..., None]

    vectors = native.vector_folds()
    native.vector_folds(False)
    arrays_ms, arrays_err = ms(from_codes), (from_codes() - reference()).abs().max().item()
    native.vector_folds(vectors)
    return {"blocks": n, "bits": bits, "decode_ms": ms(decoded), "decode_then_attend_ms": ms(reference),
            "codes_ms": ms(from_codes), "max_abs_err": (from_codes() - reference()).abs().max().item(),
            "vector_folds": vectors, "codes_arrays_ms": arrays_ms, "arrays_max_abs_err": arrays_err}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[102, 816])
    parser.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--pool", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=RESULT.name, help="result file name under bench/results/micro/")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native codec library is not built (setup.py build_ext --inplace)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.blocks:
        rows.append(case(n, args.bits, 4 if args.pool == "fp32" else 2))
        print(rows[-1])
    out = RESULT.parent / Path(args.out).name  # a name, never a path: results stay under bench/results/micro
    out.write_text(json.dumps({"threads": args.threads, "pool": args.pool, "bits": args.bits, "rows": rows},
                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
