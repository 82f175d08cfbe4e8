#!/bin/bash
# Builds FlashMask V3 (PaddlePaddle/flash-attention's FA3-based Hopper kernel, the paper's own) as a
# PyTorch extension, to benchmark against. Offline, sm_90a, bf16, head dim 128, only the features
# its `flashmask_attention(q, k, v, startend_row_indices, causal=...)` path needs.
#
#   bash tools/peers/build_flashmask_v3.sh PEERS_DIR OUT_DIR
#
# PEERS_DIR holds flashmask_v3_src-*.tar.xz (its sources) and cutlass_*_include.tar.xz (the CUTLASS
# headers of its pinned submodule). The build tree stays in $FMV3_BUILD_DIR (default
# .peerbuild/flashmask_v3), so a second call resumes an interrupted build where ninja left it.
# OUT_DIR receives flashmask_v3_hd128.tar.xz (1.6 MB; built in ~7 minutes on 16 cores, and kept:
# a later call with it in OUT_DIR reuses it): flashmask/_C.abi3.so (stripped) + interface_torch.py,
# importable with that folder on sys.path (flashmask3.bench_peers does this).
#
# Patched around, in a copy of setup_torch.py (their sources stay as they are):
#   - it calls `git submodule update`, which needs git and the network: dropped;
#   - it hard-codes head dims 64/128/256 on: 64 and 256 turned off;
#   - `-lineinfo`: dropped, it only makes the library larger.
set -eu
peers=${1:?usage: build_flashmask_v3.sh PEERS_DIR OUT_DIR}
out=${2:?usage: build_flashmask_v3.sh PEERS_DIR OUT_DIR}
peers=$(cd "$peers" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
packed="$out/flashmask_v3_hd128.tar.xz"
if [ -f "$packed" ]; then
    echo "$packed is there already: reusing it (delete it to rebuild)"
    exit 0
fi
work=${FMV3_BUILD_DIR:-.peerbuild/flashmask_v3}
mkdir -p "$work"
cd "$work"
if [ ! -d flashmask ]; then
    tar xf "$peers"/flashmask_v3_src-*.tar.xz
fi
src=flashmask/flash_mask/flashmask_attention_v3
if [ ! -d "$src/cutlass/include" ]; then
    tar xf "$peers"/cutlass_*_include.tar.xz -C "$src"  # holds cutlass/include, as its paths expect
fi
cd "$src"
mkdir -p flashmask  # build_ext --inplace puts flashmask/_C.abi3.so here
sed -e 's/^subprocess.run(\["git", "submodule".*$/pass  # no git, no network/' \
    -e 's/^DISABLE_HDIM64 = False.*/DISABLE_HDIM64 = True/' \
    -e 's/^DISABLE_HDIM256 = False.*/DISABLE_HDIM256 = True/' \
    -e '/"-lineinfo",/d' \
    setup_torch.py > setup_offline.py
export FLASH_MASK_V3_OFFLINE_BUILD=1 FLASH_MASK_V3_FORCE_BUILD=TRUE
export FLASH_MASK_V3_DISABLE_HDIMDIFF192=TRUE FLASH_MASK_V3_DISABLE_HDIMDIFF64=TRUE
export FLASH_MASK_V3_DISABLE_APPENDKV=TRUE FLASH_MASK_V3_DISABLE_CLUSTER=TRUE
# One architecture per file: nvcc's --threads has nothing to split, the cores go to parallel files.
export MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=1
start=$(date +%s)
python3 setup_offline.py build_ext --inplace
echo "build: $(( $(date +%s) - start ))s"
lib=$(ls flashmask/_C*.so)
strip --strip-unneeded "$lib"
tar cJf "$packed" "$lib" interface_torch.py
ls -l "$lib" "$packed"
