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
import ctypes
import json
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.micro.decode_attention import ms
from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import EncodedBlock, encode_rows
from confkv_engine.cache.codec.spec import CodecSpec

SOURCE = Path(__file__).with_name("_codes_attention.c")
RESULT = Path(__file__).parents[1] / "results" / "micro" / "codes_attention.json"
BS = 16


def build() -> ctypes.CDLL:
    """Compile the prototype (gcc, OpenMP) into a temporary folder and load it."""
    out = Path(tempfile.mkdtemp()) / "codes_attention.so"
    subprocess.run(["gcc", "-O3", "-fopenmp", "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.pa_all.restype = None
    return lib


class Blocks:
    """N encoded int4 K and V blocks [BS, H, D] with their fp32 group parameters, and queries."""

    def __init__(self, n: int, heads: int, group: int, dim: int, dtype: torch.dtype = torch.float32) -> None:
        self.n, self.heads, self.group, self.dim = n, heads, group, dim
        self.kspec, self.vspec = block_codecs(BS, heads, dim, 4, dim, element_bytes=4)
        self.k = encode_rows(torch.randn(n, BS, heads, dim), self.kspec)
        self.v = encode_rows(torch.randn(n, BS, heads, dim), self.vspec)
        self.ks, self.km = _params(self.k, self.kspec)
        self.vs, self.vm = _params(self.v, self.vspec)
        self.q = torch.randn(heads, group, dim).to(dtype)

    def decoded(self) -> tuple[Tensor, Tensor]:
        """K and V decoded by the native codec: [H, N * BS, D] fp32 each."""
        shape = (self.n, BS, self.heads, self.dim)
        kd, vd, dst = torch.empty(shape), torch.empty(shape), torch.arange(self.n)
        if not (native.decode_into(self.k, self.kspec, self.ks, self.km, kd, dst)
                and native.decode_into(self.v, self.vspec, self.vs, self.vm, vd, dst)):
            raise RuntimeError("the native codec is not built (setup.py build_ext --inplace)")
        return (x.view(self.n * BS, self.heads, self.dim).transpose(0, 1) for x in (kd, vd))  # type: ignore[return-value]

    def reference(self) -> Tensor:
        k, v = self.decoded()
        return F.scaled_dot_product_attention(self.q.float(), k, v)

    def from_codes(self, lib: ctypes.CDLL, parts: int = 2) -> Tensor:
        """[H, G, D] fp32 attention output of the prototype."""
        if self.group > 8 or self.dim > 128:
            raise ValueError("the prototype holds at most 8 queries per KV head and head_dim 128")
        out, q = torch.empty(self.heads, self.group, self.dim), self.q.float().contiguous()
        p = ctypes.c_void_p
        lib.pa_all(p(self.k.data_ptr()), ctypes.c_int64(self.k.stride(0)), p(self.ks.data_ptr()),
                   p(self.km.data_ptr()), p(self.v.data_ptr()), ctypes.c_int64(self.v.stride(0)),
                   p(self.vs.data_ptr()), p(self.vm.data_ptr()), p(q.data_ptr()), self.group, self.n, BS,
                   self.heads, self.dim, ctypes.c_float(self.dim ** -0.5), parts, torch.get_num_threads(),
                   p(out.data_ptr()))
        return out


def _params(rows: Tensor, spec: CodecSpec) -> tuple[Tensor, Tensor]:
    """fp32 (scales, mins) [N, *groups_shape] of encoded rows [N, nbytes]."""
    blocks = [EncodedBlock.from_bytes(r, spec) for r in rows]
    return (torch.stack([b.scales.float() for b in blocks]).contiguous(),
            torch.stack([b.mins.float() for b in blocks]).contiguous())


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
