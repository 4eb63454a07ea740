#!/usr/bin/env bash
# One device call for issue 17's open checks (device tool; writes under $OUT, prints the tables last):
#   1. builds v41._cuda from source (the device's nvcc, ~60 s);
#   2. a smoke launch of each weight-streaming variant (wstream.VARIANT 1-3: shared-memory stages, bulk copies),
#      so a hang costs 60 s, not the call;
#   3. the weight-streaming GEMM's GPU tests at every variant (tests/test_gpu_cuda.py);
#   4. kernel_bench.py: experts at B = 1, 8, 64 and dense linears at M = 1, 8, each variant;
#   5. flash-slice-v41 decode at C = 2,048, B = 1 and 64, fp8 records, with variant 0 and with the variants step 4
#      found fastest (experts by their B = 8 and 64 cells, linears by their M = 1 and 8 cells).
# carry: ["python/v41/_native.abi3.so"].   run: bash benches/gpu/issue17_check.sh   (~9 min)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
timeout 60 python3 - > "$OUT/smoke.txt" 2>&1 <<'PY'
import torch
from v41.kernels import moe_align, wstream
from v41.kernels.packed import PackedWeight
e, n, k = 384, 4608, 5120
w = PackedWeight(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                 torch.randint(116, 122, (e, n, k // 32), dtype=torch.uint8, device="cuda"), "mxfp4", (1, 32))
ids = torch.rand(64, e, device="cuda").topk(6, dim=1).indices
pairs = moe_align.route_pairs(ids, e)
x = torch.randn(64, k, device="cuda").to(torch.bfloat16)
ys = []
for v in range(4):
    wstream.VARIANT = v
    ys.append(wstream.grouped(x, w, pairs.offsets, pairs.rows, pairs.active).float())
    torch.cuda.synchronize()
    print(f"variant {v}: ran, max |y - y0| = {(ys[-1] - ys[0]).abs().max().item():.3g}", flush=True)
PY
cat "$OUT/smoke.txt" | tail -4
if [ "$(grep -c ': ran' "$OUT/smoke.txt")" != 4 ]; then echo "smoke failed: staged variants left out"; VARS=""; else VARS=1,2,3; fi
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_cuda.py > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 120 python3 benches/gpu/kernel_bench.py --ops experts --batches 1,8,64 --variants "$VARS" > "$OUT/kb_e.txt" 2>&1
timeout 90 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,8 --variants "$VARS" > "$OUT/kb_l.txt" 2>&1
# the fastest variant by the summed µs of the given rows of a kernel_bench table (0 when none is faster)
best() { python3 - "$1" "$2" <<'PY'
import sys
tot = [0.0] * 4
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.split("|")[1:-1]]
    if len(c) >= 12 and c[1] in sys.argv[2].split(","):
        for v, col in enumerate((2, 9, 10, 11)):
            tot[v] += float(c[col].replace(",", ""))
print(min(range(4), key=lambda v: tot[v]) if tot[0] else 0)
PY
}
GV=$(best "$OUT/kb_e.txt" B=8,B=64 2>/dev/null); LV=$(best "$OUT/kb_l.txt" M=1,M=8 2>/dev/null)
GV=${GV:-0}; LV=${LV:-0}; echo "fastest: grouped $GV, linear $LV"
for pair in 0:0 $GV:$LV; do
  tag=${pair/:/_}
  [ "$pair" = 0:0 ] && [ -f "$OUT/fs0_0.txt" ] && continue
  [ "$SECONDS" -gt 470 ] && { echo "flash $pair skipped (time)"; continue; }
  timeout 90 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , --kv-cache-dtype fp8 \
    --set "v41.kernels.wstream.GROUPED_VARIANT=${pair%:*}" --set "v41.kernels.wstream.LINEAR_VARIANT=${pair#*:}" \
    --out "$OUT/fs$tag" > "$OUT/fs$tag.txt" 2>&1
  echo "GROUPED_VARIANT:LINEAR_VARIANT=$pair:"; tail -3 "$OUT/fs$tag.txt"
done
tail -12 "$OUT/kb_e.txt"
tail -20 "$OUT/kb_l.txt" | cut -c1-200
