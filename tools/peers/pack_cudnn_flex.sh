#!/bin/bash
# Packs cuDNN frontend's interval-mask attention (`cudnn.flex_attention`) for a benchmark machine
# without a registry: from the nvidia-cudnn-frontend wheel, only that subpackage and the modules it
# imports (with an empty `cudnn/__init__.py`, which would load everything else), ~5 MB instead of
# the wheel's 12. Unpack it and name the folder in FLASHMASK3_CUDNN_FLEX_PATH (flashmask3.bench_peers).
#
#   bash tools/peers/pack_cudnn_flex.sh OUT_DIR [PYTHON_VERSION]   # default 3.12, the H200's
set -eu
out=${1:?usage: pack_cudnn_flex.sh OUT_DIR [PYTHON_VERSION]}
python_version=${2:-3.12}
version=1.32.0
work=$(mktemp -d)
pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
    --platform manylinux_2_28_x86_64 -d "$work" "nvidia-cudnn-frontend==$version"
python3 -m zipfile -e "$work"/nvidia_cudnn_frontend-*.whl "$work/wheel"
mkdir -p "$work/pack/cudnn" "$out"
: > "$work/pack/cudnn/__init__.py"
cd "$work/wheel/cudnn"
cp -r flex_attention _cutlass_compat.py _torch_stream.py api_base.py _tupledict.py \
    _experimental_warnings.py datatypes.py tensor_adapter.py _compiled_module.*.so "$work/pack/cudnn/"
tar cJf "$(cd "$OLDPWD" && cd "$out" && pwd)/cudnn_flex_attention-$version.tar.xz" -C "$work/pack" cudnn
rm -rf "$work"
