"""The codes-attention prototype's library: decode attention over int4 frozen blocks straight from
their codes (``_codes_attention.c``, compiled with the system's C compiler into a temporary folder,
since it is no part of the install), and the blocks it reads (real codec encodings of random K and V,
with the reference: the native decode plus ``scaled_dot_product_attention``). Shared by its
benchmark (``bench.micro.codes_attention``) and its test.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec import native
from confkv_engine.cache.codec.blocks import EncodedBlock, encode_rows
from confkv_engine.cache.codec.spec import CodecSpec

SOURCE = Path(__file__).with_name("_codes_attention.c")
BS = 16  # tokens per block, as the engine's default

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
