#!/usr/bin/env bash
# Stage FlashMLA's SM90 sparse-decode sources and the CUTLASS / CuTe headers they need into .flashmla/ (ignored by
# git through .git/info/exclude, never committed), for benches/gpu/flashmla_compare.py on the device machine, which
# has no network: carry ".flashmla" with the call. No third-party source enters the repo.
#
#   bash benches/gpu/flashmla/stage.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR
#
# The arguments are git directories of deepseek-ai/FlashMLA and NVIDIA/cutlass (the tool library's `fetch` gives
# /work/.mirror/deepseek-ai+FlashMLA/repo and /work/.mirror/NVIDIA+cutlass/repo). The pins: FlashMLA 9241ae3 (the
# "MODEL1" kernels: DeepSeek V4's 584-byte FP8 rows), CUTLASS at FlashMLA's submodule commit 147f567. About 28 MB.
set -euo pipefail
FLASHMLA_PIN=9241ae3
CUTLASS_PIN=147f5673d0c1c3dcf66f78d677fd647e4a020219
[ $# -eq 2 ] || { echo "usage: $0 FLASHMLA_GIT_DIR CUTLASS_GIT_DIR" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
dest="$root/.flashmla"
grep -qx "/.flashmla/" "$root/.git/info/exclude" 2>/dev/null || echo "/.flashmla/" >> "$root/.git/info/exclude"
rm -rf "$dest"
mkdir -p "$dest/cutlass"
git -C "$1" archive "$FLASHMLA_PIN" LICENSE csrc/params.h csrc/defines.h csrc/utils.h csrc/kerutils \
  csrc/sm90/helpers.h csrc/sm90/decode/sparse_fp8 csrc/sm90/prefill/sparse csrc/smxx | tar -x -C "$dest"
git -C "$2" archive "$CUTLASS_PIN" LICENSE.txt include | tar -x -C "$dest/cutlass"
echo "staged $(du -sh "$dest" | cut -f1) in $dest"
