"""The native part of the build: the codec's block decoder (``cache/codec/_dequant.c``) and the
int8- and int4-weight matmuls for CPUs (``model/_q8matmul.c``; the same library, ``_native``, holds
the layers' row-wise blocks, ``model/_rowops.c``) and
the decode attention read from the paged pool (``attention/kernels/_decode.c``) and the attention
mass retention folds at decision steps (``retention/_mass.c``).

Everything else is declared in pyproject.toml. The library is plain C with a C ABI (no Python or
PyTorch headers; ``codec.native`` loads it with ctypes), optional: without a C compiler the install
goes on and the codec decodes with PyTorch ops. OpenMP where the compiler has it.
"""

import os
import sys

from setuptools import Extension, setup

OPENMP = [] if sys.platform == "darwin" or os.environ.get("CONFKV_NO_OPENMP") else ["-fopenmp"]

setup(ext_modules=[
    Extension(
        "confkv_engine.cache.codec._dequant",
        sources=["engine/confkv_engine/cache/codec/_dequant.c",  # the block decoder
                 "engine/confkv_engine/cache/codec/_codes.c",  # attention straight from the codes
                 "engine/confkv_engine/cache/codec/_codes_vec.c"],  # ... in 8-lane vectors
        depends=["engine/confkv_engine/_expf.h",  # the exp the native libraries share
                 "engine/confkv_engine/cache/codec/_codes.h"],
        extra_compile_args=["-O3", "-ffp-contract=off", *OPENMP],
        extra_link_args=OPENMP,
        libraries=["m"],
        optional=True,
    ),
    # No -march: the AVX2 and AVX-512 VNNI paths carry their own target options and are chosen at
    # run time, so one build runs on any x86-64 CPU (and the scalar path anywhere else). The library
    # holds the int8- and int4-weight matmuls (_q8matmul.c, their fused greedy argmax: _q8argmax.c,
    # their AVX2 tiles: _q8avx2.c, their activations: _qacts.c) and the layers'
    # row-wise blocks (_rowops.c: RMSNorm, RoPE, gated activation).
    Extension(
        "confkv_engine.model._native",
        sources=["engine/confkv_engine/model/_q8matmul.c", "engine/confkv_engine/model/_q8argmax.c",
                 "engine/confkv_engine/model/_q8avx2.c", "engine/confkv_engine/model/_qacts.c",
                 "engine/confkv_engine/model/_rowops.c"],
        depends=["engine/confkv_engine/model/_qcommon.h", "engine/confkv_engine/model/_q8tile.h",
                 "engine/confkv_engine/_expf.h"],
        extra_compile_args=["-O3", *OPENMP],
        extra_link_args=OPENMP,
        libraries=["m"],
        optional=True,
    ),
    # Decode attention read from the paged pool; its per-row body is cloned for AVX-512 / AVX2 /
    # x86-64 by the compiler (target_clones), chosen at load.
    Extension(
        "confkv_engine.attention.kernels._decode",
        sources=["engine/confkv_engine/attention/kernels/_decode.c",  # the plain-C path, the entry point
                 "engine/confkv_engine/attention/kernels/_decode_simd.c"],  # the AVX-512 and AVX2 paths
        depends=["engine/confkv_engine/_expf.h", "engine/confkv_engine/attention/kernels/_decode.h"],
        extra_compile_args=["-O3", *OPENMP],
        extra_link_args=OPENMP,
        libraries=["m"],
        optional=True,
    ),
    # The attention mass a retention decision folds (retention/_mass.c), cloned per ISA likewise.
    Extension(
        "confkv_engine.retention._mass",
        sources=["engine/confkv_engine/retention/_mass.c"],
        depends=["engine/confkv_engine/_expf.h"],
        extra_compile_args=["-O3", *OPENMP],
        extra_link_args=OPENMP,
        libraries=["m"],
        optional=True,
    ),
])
