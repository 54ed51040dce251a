"""The codec's range fit on real K/V: min/max against the least-squared-error shrunk range.

SmolLM2-135M's keys and values (post-RoPE, as cached, bf16) on 1,024 pydoc tokens of the tuning
region (from token 7,168), encoded block by block with the codecs of a bf16 pool
(``arena.block_codecs``: keys per channel along the block's 16 tokens with dq6 parameters, values per
token along head_dim with fp16 ones), once per ``fit``. Per bits: relative MSE of the decoded keys
(against the keys' mean square) and values (against their per-token variance), the relative RMS
error of the attention logits q.k (the window's last 64 queries against all its keys), and the
encode time of one block pair (K and V, all layers, as ``tiered.freeze_blocks`` encodes it; median
over the window's blocks), the fits side by side in the same run: min/max (shrink 1), the range fit
(``KEY_SHRINK`` / ``VALUE_SHRINK``; int2 only, ``FIT_MAX_BITS``) and values only. ``--rotate
hadamard`` encodes every head's k and v turned by a randomised Hadamard matrix (``testkit.rotation``)
and measures the decoded ones turned back, against the unrotated originals.

    python -m bench.micro.codec_fit --threads 1
    python -m bench.micro.codec_fit --threads 1 --bits 4 2 --rotate hadamard
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import write_report
from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.codec.blocks import decode_rows, encode_rows
from confkv_engine.cache.codec.spec import KEY_SHRINK, VALUE_SHRINK
from testkit.rotation import ROTATIONS, hadamard

RESULT = Path(__file__).parents[1] / "results" / "micro" / "codec_fit.json"
START, SIZE, BS = 7168, 1024, 16
# (key shrink, value shrink): min/max, the range fit (``block_codecs(range_fit=True)``), values only
FITS = {"minmax": (1.0, 1.0), "fit": (KEY_SHRINK, VALUE_SHRINK), "v-only": (1.0, VALUE_SHRINK)}


class Capture:
    """An attention backend that keeps every layer's q, k, v and attends causally (dense)."""

    def __init__(self) -> None:
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.q[layer], self.k[layer], self.v[layer] = q.clone(), k.clone(), v.clone()
        t, hq, d = q.shape
        g = hq // k.shape[1]
        kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        scores = torch.einsum("thd,shd->hts", q.float(), kf) / math.sqrt(d)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        scores = scores.masked_fill(~(j <= i)[None], float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), vf).to(q.dtype)


def capture() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [L, T, Hq, D], k and v [L, T, Hkv, D] of the window, bf16."""
    from confkv_engine.model.loader import load_model
    from testkit.kv_runs import pydoc_tokens

    loaded = load_model("builtin:smollm2-135m", torch.bfloat16, "cpu")
    tokens = pydoc_tokens(loaded.tokenizer)[START:START + SIZE]
    cap = Capture()
    with torch.inference_mode():
        loaded.model(torch.tensor(tokens), torch.arange(len(tokens)), cap)
    return tuple(torch.stack([d[i] for i in range(len(d))]) for d in (cap.q, cap.k, cap.v))


def blocks(x: torch.Tensor) -> torch.Tensor:
    """[L, T, H, D] -> [T / BS, L, BS, H, D]: one entry per pool block (all layers)."""
    layers, t, h, d = x.shape
    return x.reshape(layers, t // BS, BS, h, d).movedim(1, 0)


def run_fit(kb: torch.Tensor, vb: torch.Tensor, bits: int, shrink: tuple[float, float]) -> dict:
    heads, dim = kb.shape[3], kb.shape[4]
    codecs = block_codecs(BS, heads, dim, bits, dim)
    k_spec, v_spec = (replace(s, shrink=r) for s, r in zip(codecs, shrink, strict=True))
    times, k_dec, v_dec = [], [], []
    for kblock, vblock in zip(kb, vb, strict=True):
        t0 = time.perf_counter()
        k_rows, v_rows = encode_rows(kblock, k_spec), encode_rows(vblock, v_spec)
        times.append(time.perf_counter() - t0)
        k_dec.append(decode_rows(k_rows, k_spec))
        v_dec.append(decode_rows(v_rows, v_spec))
    return {"encode_ms": 1e3 * statistics.median(times), "k": torch.stack(k_dec), "v": torch.stack(v_dec)}


def errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor) -> dict:
    kf, vf = k.float(), v.float()
    k_mse = ((kd - kf).square().mean() / kf.square().mean()).item()
    v_mse = ((vd - vf).square().mean() / (vf - vf.mean(-1, keepdim=True)).square().mean()).item()
    g = q.shape[2] // k.shape[2]
    qq = q[:, -64:].float()
    ref = torch.einsum("lthd,lshd->lhts", qq, kf.repeat_interleave(g, 2))
    got = torch.einsum("lthd,lshd->lhts", qq, kd.repeat_interleave(g, 2))
    logits = ((got - ref).square().mean() / ref.var()).sqrt().item()
    return {"k_rel_mse": k_mse, "v_rel_mse": v_mse, "logit_rel_rms": logits}


def layer_errors(v: torch.Tensor, vd: torch.Tensor) -> list[float]:
    """Per layer: the values' relative MSE (as ``errors``), rounded to 4 digits."""
    vf = v.float()
    err = (vd - vf).square().flatten(1).mean(1)
    var = (vf - vf.mean(-1, keepdim=True)).square().flatten(1).mean(1)
    return [round(x, 4) for x in (err / var).tolist()]


def rotated(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ rotation, in x's dtype (the cache stores the rotated bf16 values)."""
    return (x.float() @ rotation).to(x.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    ap.add_argument("--rotate", choices=ROTATIONS, default="none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q, k, v = capture()
    r_mat = hadamard(k.shape[-1]) if args.rotate == "hadamard" else torch.eye(k.shape[-1])
    kb, vb = blocks(rotated(k, r_mat)), blocks(rotated(v, r_mat))
    rows = []
    for bits in args.bits:
        for fit, shrink in FITS.items():
            r = run_fit(kb, vb, bits, shrink)
            layers = k.shape[0]
            kd = r["k"].movedim(0, 1).reshape(layers, SIZE, *k.shape[2:]) @ r_mat.T
            vd = r["v"].movedim(0, 1).reshape(layers, SIZE, *v.shape[2:]) @ r_mat.T
            row = {"bits": bits, "fit": fit, "shrink_kv": shrink, "encode_ms_per_block_pair": r["encode_ms"],
                   **errors(q, k, v, kd, vd), "v_rel_mse_per_layer": layer_errors(v, vd)}
            rows.append(row)
            print(f"int{bits} {fit:7s} K relMSE {row['k_rel_mse']:.5f}  V relMSE {row['v_rel_mse']:.5f}  "
                  f"logits relRMS {row['logit_rel_rms']:.4f}  "
                  f"encode {row['encode_ms_per_block_pair']:.2f} ms",
                  flush=True)
    out = args.out or (RESULT if args.rotate == "none" else RESULT.with_name(f"codec_fit-{args.rotate}.json"))
    write_report({"threads": args.threads, "tokens": SIZE, "start": START, "rotate": args.rotate,
                  "rows": rows}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
