#!/usr/bin/env bash
# Device calls for issue 17's open checks (device tool; writes under $OUT). A call first builds v41._cuda from
# source (the device's nvcc, ~60 s). MODE= one mode or several, comma-separated (one build, then each in turn):
#   tests    (~5 min) programmatic dependent launch (tests/test_gpu_pdl.py, tests/test_gpu_side_stream.py) and the
#            cuda/ kernel tests (weight-streaming GEMM with its split-K sum and slice-bytes floor, sparse MQA,
#            index scores, top-k);
#   tests2   (~4 min) the MoE router's and the mHC seam's CUDA tests (their 384-expert CPU references are slow);
#   engine   (~4 min) the Triton kernel checks in bf16 and float32, the engine's greedy tokens = the CPU engine's on
#            tiny V4.1, no host synchronisation in a decode forward or in the sampler (K1, T1: another -k and time
#            limit); PROFILE=1 then profiles a B = 1 step with PDL and the side stream off (with them on, kernel
#            times overlap);
#   slices   (~4 min) flash-slice-v41 (C = 2,048, fp8 records, B = 1 and 64) and flash-slice-v4 (B = 1, 8, 64);
#   final    (~6 min) the RoPE / RMSNorm checks, flash-slice-v41 B = 1, 64 and its prefill rates at 2,048 /
#            8,192 tokens; flash-slice-v4 B = 1; the device host's Python path of a V4 graph step (host_step.py);
#   profiles (~7 min) B = 1 decode profiles of flash-slice-v41 (fp8) and -v4 and the 8,192-token prefill profile
#            (PDL and the side stream off);
#   table    (~7 min) the per-kernel table of issue 17: kernel_bench.py (linears, experts, sparse MQA, indexer
#            scores and top-k at B = 1, 8, 64), glue_bench.py (mHC mixes, float32-output linears, the sampler's
#            race at 1, 8, 64 tokens; the mixes at 2,048 / 8,192), moe_bench.py at 2,048 / 8,192 tokens;
#   paths    (~3 min) the MoE prefill path's tests (tests/test_moe_prefill.py, check_moe_prefill), then the MoE
#            prefill GEMM four ways (moe_prefill_paths.py: W4A16, pipelined, bf16 and FP8 grouped GEMMs; CHUNKS=
#            its --chunks cells, experts per chunk[:dequantization programs]);
#   long     (~4 min) flash-slice-v41 decode at 32k, 128k and 1M tokens of context (recency prefill), its cache per
#            kind; LONG_REAL=1 prefills with the real indexer (~4 min more at 1M);
#   moe      (~2 min) the MoE GEMM at 2,048- and 8,192-token prefill chunks over V4.1's experts (moe_bench.py);
#            the mHC mixes at prefill sizes (glue_bench.py --ops mhc: columns "64-token tiles" / "16-token tiles"
#            set mhc.MIX_WIDE_T to 1 / 0);
#   prefill2 (~8 min) the MoE kernel's GPU checks in bf16 and tests/test_gpu_mxfp4_bits.py (the PTX bit-move
#            decode of every byte and scale byte; the prefill launch), then moe_bench.py over V4.1's experts at 2,048
#            and 8,192 tokens, uniform and Zipf-skewed routing (--skew 1): the default prefill tiles (64-row blocks
#            over 4 warps, K 64, bit moves, programs per row block) with the 128-register cap, with 168 (no
#            spills, three CTAs per SM) and with 2 stages (16 bytes spilled), each checked against its reference
#            there; then the 2,048- and 8,192-token prefills of flash-slice-v41 in interleaved PF cells
#            (BM:warps:BK:maxnreg:decode:row grid);
#   swap     (~9 min) the MoE kernel's bf16 GPU checks, then moe_bench.py at 1,024 / 2,048 / 8,192 tokens (16, 32,
#            128 pairs per expert) over 8 warps, 64-, 32- and 16-token blocks, with the bit-move weight tile as the
#            MMA's N side (swap 0) or its left operand (1; moe.PREFILL_SWAP; 1,024 tokens take the decode tiles by
#            default), 128-token blocks over 4 warps and the 168-register cap at 4,096 / 8,192 tokens, then the
#            flash-slice-v41 prefills in SW cells (swap:warps:BM; the default tiles, the swap at 8
#            warps, 8 warps alone, the swap in 32-token blocks);
#   splits   (~3 min) kernel_bench.py linears at 1 and 8 rows with the K split forced to 1-12 slices (columns
#            split<n>): what the split-K sum and the CTAs per SM cost each projection;
#   flashmla (~5 min) FlashMLA's SM90 sparse FP8 decode kernel for V4 rows built from the staged sources
#            (benches/gpu/flashmla/stage.sh here first; carry ".flashmla" too), then flashmla_compare.py: it against
#            v41's CUDA sparse MQA on the same rows at B = 1, 8, 64 (the public-kernel comparison of issue 17);
#   topk     (~3 min) the CUDA top-k's tests (tests/test_gpu_cuda_topk.py: both finishes of the one-CTA rows) and
#            its cells (kernel_bench.py --ops topk: the "cuda, ordered finish" column sets topk.ORDERED_MAX_N to
#            8,192), then flash-slice-v41 B = 1 with ORDERED_MAX_N 0 and 8,192 (four top-k launches per step);
#   side     (~4 min) the side stream's GPU tests (logits bit for bit with it, PDL on), then flash-slice-v41 at
#            B = 8 and 64 with it on for one-token steps only (side_stream.MAX_TOKENS = 1) and for steps up to 64
#            tokens (the default since 2026-12-05 (evening): 8);
#   hf       (~5 min) flash-slice-v4 decode B = 1, 8 and the 2,048-token prefill, v41 and transformers in the same
#            call (carry ".hfwhl" too: the transformers 5.23 wheel, `pip download --no-deps transformers==5.23.0 -d
#            .hfwhl`; RESULTS' earlier transformers figures used 5.23, the device has 5.17);
#   wide     (~4 min) the Triton sparse-MQA checks on the GPU (the wide tiling of 64 heads a program and its
#            dispatch, bf16) and the sparse-MQA cells (kernel_bench.py --ops attention: the "triton wide" column), then
#            the 8,192-token prefill of flash-slice-v41 over bf16 rows (the wide tiling does not take records) with
#            sparse_attention.WIDE_MIN_TOKENS 0 and 256.
# The one-off A/B modes of finished experiments (kernels, glue, verify, seam, seam_ab, router, dbuf, router2, final2,
# launches) are gone; benches/RESULTS.md names each call's mode and date, and git history holds the script it ran.
# The exit status is 1 when a test run failed.
# carry: ["python/v41/_native.abi3.so"] (MODE=flashmla: also ".flashmla"). On an 80 GB H100 set GPU_UTIL=0.97: the
# engines' gpu_memory_utilization (flash_slice.py; flash-slice-v41's weights take ~72 GB, 0.9 leaves no KV cache).
#   run: MODE=tests bash benches/gpu/issue17_check.sh      (or MODE=paths,moe: both after one build; the modes'
#        typical times must sum to under the device's 10 minutes a call; the timeouts are safety nets, and a call
#        cut at 10 minutes still returns what $OUT holds)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/python:$PWD/tests:$PWD/benches/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODE=${MODE:-tests}
PF=${PF:-64:4:64:128:bits:1,64:4:64:168:bits:1,64:4:64:128:bits:1,64:4:64:168:bits:1}
SW=${SW:-0:4:64,1:8:64,0:8:64,1:8:32}
MODES=" tests tests2 engine slices final profiles table paths long moe prefill2 swap splits flashmla topk side wide hf "
for mode in ${MODE//,/ }; do  # every mode checked before any device time goes
  [[ "$MODES" == *" $mode "* ]] || { echo "MODE must be among:$MODES(comma-separated)"; exit 2; }
done
for v in ${PF//,/ }; do  # prefill2's cells, checked before any device time goes too
  [[ $v =~ ^[0-9]+:[0-9]+:(64|128):[0-9]+:(bits|scaled|nibble):[01]$ ]] || {
    echo "PF cell $v: expected BM:warps:BK:maxnreg:decode:row grid (BK 64 or 128; decode bits, scaled or nibble)"; exit 2; }
done
for v in ${SW//,/ }; do  # swap's cells too
  [[ $v =~ ^[01]:(4|8):(16|32|64|128)$ ]] || {
    echo "SW cell $v: expected swap:warps:BM (swap 0 or 1, warps 4 or 8)"; exit 2; }
done
rm -f python/v41/_cuda.so
timeout 100 python3 cuda/build.py > "$OUT/build.txt" 2>&1; tail -1 "$OUT/build.txt"
[ -f python/v41/_cuda.so ] || { echo "v41._cuda did not build: $OUT/build.txt"; exit 1; }
PT="python3 -m pytest -q -p no:cacheprovider --durations=8"
rc=0
for mode in ${MODE//,/ }; do
echo "== MODE=$mode"
case "$mode" in
  tests)
    timeout 150 $PT tests/test_gpu_pdl.py tests/test_gpu_side_stream.py > "$OUT/tests0.txt" 2>&1 || rc=1
    tail -8 "$OUT/tests0.txt"
    timeout 300 $PT tests/test_gpu_cuda.py tests/test_gpu_cuda_attention.py tests/test_gpu_cuda_topk.py \
      tests/test_gpu_cuda_indexer.py > "$OUT/tests1.txt" 2>&1 || rc=1
    tail -12 "$OUT/tests1.txt" ;;
  tests2)
    timeout 300 $PT tests/test_gpu_cuda_router.py tests/test_gpu_cuda_mhc.py > "$OUT/tests1b.txt" 2>&1 || rc=1
    tail -4 "$OUT/tests1b.txt" ;;
  engine)
    timeout "${T1:-280}" $PT tests/test_gpu_fast.py \
      -k "${K1:-triton_kernel_equals or (greedy and deepseek_v41) or host_synchronisation}" > "$OUT/tests2.txt" 2>&1 || rc=1
    tail -12 "$OUT/tests2.txt"
    if [ "${PROFILE:-0}" = 1 ]; then
      timeout 150 python3 benches/gpu/profile_step.py --slice v41 --batch 1 --context 2048 --prefill 0 \
        --kv-cache-dtype fp8 --top 60 --set v41.kernels.pdl.ENABLED=0 \
        --set v41.kernels.side_stream.ENABLED=0 > "$OUT/profile_b1.txt" 2>&1
      grep -A30 "== decode" "$OUT/profile_b1.txt" | head -34
    fi ;;
  slices)
    timeout 200 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill , \
      --kv-cache-dtype fp8 --out "$OUT/fs_v41" > "$OUT/fs_v41.txt" 2>&1
    tail -4 "$OUT/fs_v41.txt"
    timeout 200 python3 benches/gpu/flash_slice.py --slice v4 --cells 1x2048,8x2048,64x2048 --prefill , \
      --out "$OUT/fs_v4" > "$OUT/fs_v4.txt" 2>&1
    tail -5 "$OUT/fs_v4.txt" ;;
  final)
    timeout 100 $PT tests/test_gpu_fast.py -k "triton_kernel_equals and norm_rope" > "$OUT/tests8.txt" 2>&1 || rc=1
    tail -2 "$OUT/tests8.txt"
    timeout 300 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048,64x2048 --prefill 2048,8192 \
      --kv-cache-dtype fp8 --out "$OUT/fs_v41" > "$OUT/fs_v41.txt" 2>&1
    tail -6 "$OUT/fs_v41.txt"
    timeout 90 python3 benches/gpu/flash_slice.py --slice v4 --cells 1x2048 --prefill , \
      --out "$OUT/fs_v4" > "$OUT/fs_v4.txt" 2>&1
    tail -3 "$OUT/fs_v4.txt"
    # this host's Python path of a graph decode step (CPU only: the v4 B = 1 cell is bound by it on slow hosts)
    timeout 60 python3 benches/host_step.py --arch deepseek_v4 --batch 1 --graph --greedy --steps 500 2>&1 | tail -1 ;;
  profiles)
    timeout 150 python3 benches/gpu/profile_step.py --slice v41 --batch 1 --context 2048 --prefill 0 \
      --kv-cache-dtype fp8 --top 80 --set v41.kernels.pdl.ENABLED=0 \
      --set v41.kernels.side_stream.ENABLED=0 > "$OUT/profile_b1.txt" 2>&1
    grep -A24 "== decode" "$OUT/profile_b1.txt" | head -26
    timeout 120 python3 benches/gpu/profile_step.py --slice v4 --batch 1 --context 2048 --prefill 0 \
      --top 80 --set v41.kernels.pdl.ENABLED=0 \
      --set v41.kernels.side_stream.ENABLED=0 > "$OUT/profile_v4_b1.txt" 2>&1
    grep -A16 "== decode" "$OUT/profile_v4_b1.txt" | head -18
    timeout 200 python3 benches/gpu/profile_step.py --slice v41 --batch 1 --context 256 --prefill 8192 \
      --kv-cache-dtype fp8 --top 40 --set v41.kernels.pdl.ENABLED=0 \
      --set v41.kernels.side_stream.ENABLED=0 > "$OUT/profile_prefill.txt" 2>&1
    grep -A20 "== prefill" "$OUT/profile_prefill.txt" | head -22 ;;
  table)
    timeout 150 $PT tests/test_gpu_fast.py -k "triton_kernel_equals and (norm_rope or mhc)" > "$OUT/tests7.txt" 2>&1 || rc=1
    tail -2 "$OUT/tests7.txt"
    timeout 240 python3 benches/gpu/kernel_bench.py --batches 1,8,64 --reps 16 > "$OUT/kernels.txt" 2>&1
    tail -40 "$OUT/kernels.txt"
    timeout 100 python3 benches/gpu/glue_bench.py > "$OUT/glue.txt" 2>&1
    tail -12 "$OUT/glue.txt"
    timeout 60 python3 benches/gpu/glue_bench.py --tokens 2048,8192 --ops mhc > "$OUT/glue_prefill.txt" 2>&1
    tail -3 "$OUT/glue_prefill.txt"
    timeout 120 python3 benches/gpu/moe_bench.py --shape v41 --batches 2048,8192 --reps 5 > "$OUT/moe.txt" 2>&1
    tail -6 "$OUT/moe.txt" ;;
  paths)
    timeout 120 $PT tests/test_moe_prefill.py tests/test_gpu_fast.py -k "moe_prefill or dequant_mm or pipelined" \
      > "$OUT/tests9.txt" 2>&1 || rc=1
    tail -3 "$OUT/tests9.txt"
    timeout 300 python3 benches/gpu/moe_prefill_paths.py --chunks "${CHUNKS:-16,32,16:32}" > "$OUT/paths.txt" 2>&1
    tail -7 "$OUT/paths.txt" ;;
  long)  # LONG_REAL=1: the prefill runs the real indexer over every visible entry (no recency shortcut)
    if [ "${LONG_REAL:-0}" = 1 ]; then RECENT=""; LT=560; else RECENT="--recent-index-prefill"; LT=280; fi
    timeout $LT python3 benches/gpu/flash_slice.py --slice v41 --cells 1x32768,1x131072,1x1048320 --prefill , \
      --budget 8192 --kv-cache-dtype fp8 $RECENT --out "$OUT/fs_long" > "$OUT/fs_long.txt" 2>&1
    tail -9 "$OUT/fs_long.txt" ;;
  moe)
    timeout 200 python3 benches/gpu/moe_bench.py --shape v41 --batches 2048,8192 --reps 5 \
      > "$OUT/moe.txt" 2>&1
    tail -7 "$OUT/moe.txt"
    timeout 150 python3 benches/gpu/glue_bench.py --tokens 2048,8192 --ops mhc > "$OUT/glue_prefill.txt" 2>&1
    tail -3 "$OUT/glue_prefill.txt" ;;
  prefill2)
    timeout 150 $PT tests/test_gpu_mxfp4_bits.py tests/test_gpu_fast.py -k "bits or (triton_kernel_equals and \
      check_grouped and bf16) or prefill_launch" > "$OUT/tests19.txt" 2>&1 || rc=1
    tail -2 "$OUT/tests19.txt"
    for skew in 0 1; do  # uniform routing, then Zipf-popular experts (moe_bench.py --skew)
      timeout 200 python3 benches/gpu/moe_bench.py --shape v41 --batches 2048,8192 --reps 5 --tile-warps 4 --skew $skew \
        --tiles 64:128:64:3:128,64:128:64:3:168,64:128:64:2:128 --decodes bits --row-grids 1 > "$OUT/moe_tiles_$skew.txt" 2>&1
      echo "skew $skew:"; grep "^B=" "$OUT/moe_tiles_$skew.txt" | sed -E "s/'(split|warps|stages)': [0-9]+, //g" \
        | cut -c1-150
    done
    i=0
    for v in ${PF//,/ }; do  # PF: BM:warps:BK:maxnreg:decode:row grid cells, comma-separated
      set -- ${v//:/ }
      i=$((i + 1))
      M=v41.kernels.moe
      timeout 100 python3 benches/gpu/flash_slice.py --slice v41 --cells , --prefill 2048,8192 --kv-cache-dtype fp8 \
        --set $M.PREFILL_BM=$1 --set $M.PREFILL_WARPS=$2 --set $M.PREFILL_BK=$3 --set $M.PREFILL_MAXNREG=$4 \
        --set $M.PREFILL_DECODE=$5 --set $M.PREFILL_ROW_GRID=$6 --out "$OUT/fs_pf" > "$OUT/fs_pf_${i}_${v//:/_}.txt" 2>&1
      echo "BM=$1 warps=$2 BK=$3 maxnreg=$4 decode=$5 row grid=$6: $(grep "prefill" "$OUT/fs_pf_${i}_${v//:/_}.txt" \
        | tail -2 | tr -s ' ' | tr '\n' ' ')"
    done ;;
  swap)  # the bit-move weight tile as the MMA's left operand (moe.PREFILL_SWAP), 8 warps: two warp groups of 64
    timeout 150 $PT tests/test_gpu_fast.py -k "triton_kernel_equals and check_grouped and bf16" > "$OUT/tests20.txt" \
      2>&1 || rc=1
    tail -2 "$OUT/tests20.txt"
    timeout 260 python3 benches/gpu/moe_bench.py --shape v41 --batches 1024,2048,8192 --reps 5 --tile-warps 8 \
      --tiles 64:128:64:3:128,32:128:64:3:128,16:128:64:3:128 --decodes bits --row-grids 1 --swaps 0,1 \
      > "$OUT/moe_swap.txt" 2>&1
    grep "^B=" "$OUT/moe_swap.txt" | sed -E "s/'(split|stages|decode|row_grid)': [^,]+, //g" | cut -c1-150
    # 128-token blocks over one warp group, uncapped (254 registers, two CTAs an SM): ~47 % fewer warp-instructions
    # per MAC than the default by triton_regs.py's SASS count, at ~128 pairs per expert
    timeout 90 python3 benches/gpu/moe_bench.py --shape v41 --batches 4096,8192 --reps 5 --tile-warps 4 \
      --tiles 128:128:64:3,64:128:64:3:168 --decodes bits --row-grids 1 > "$OUT/moe_bm128.txt" 2>&1
    grep "^B=" "$OUT/moe_bm128.txt" | sed -E "s/'(split|stages|decode|row_grid)': [^,]+, //g" | cut -c1-150
    i=0
    for v in ${SW//,/ }; do  # swap:warps:BM cells: the default, then the swap and the warps apart
      set -- ${v//:/ }
      i=$((i + 1))
      M=v41.kernels.moe
      f="$OUT/fs_sw_${i}_${v//:/_}.txt"
      timeout 100 python3 benches/gpu/flash_slice.py --slice v41 --cells , --prefill 2048,8192 --kv-cache-dtype fp8 \
        --set $M.PREFILL_SWAP=$1 --set $M.PREFILL_WARPS=$2 --set $M.PREFILL_BM=$3 --out "$OUT/fs_sw" \
        > "$f" 2>&1 || { rc=1; tail -3 "$f"; }
      echo "swap=$1 warps=$2 BM=$3: $(grep "prefill" "$f" | tail -2 | tr -s ' ' | tr '\n' ' ')"
    done ;;
  splits)
    timeout 200 python3 benches/gpu/kernel_bench.py --ops linears --batches 1,8 --reps 16 --splits 1,2,3,4,6,8,12 \
      > "$OUT/splits.txt" 2>&1
    tail -21 "$OUT/splits.txt" ;;
  flashmla)
    timeout 240 python3 benches/gpu/flashmla/flashmla_ext.py > "$OUT/flashmla_build.txt" 2>&1 || rc=1
    tail -2 "$OUT/flashmla_build.txt"
    timeout 190 python3 benches/gpu/flashmla_compare.py --batches 1,8,64 > "$OUT/flashmla.txt" 2>&1 || rc=1
    tail -14 "$OUT/flashmla.txt" ;;
  topk)
    timeout 90 $PT tests/test_gpu_cuda_topk.py > "$OUT/tests12.txt" 2>&1 || rc=1
    tail -3 "$OUT/tests12.txt"
    timeout 150 python3 benches/gpu/kernel_bench.py --ops topk --reps 12 > "$OUT/topk.txt" 2>&1
    grep -A12 "indexer top-k" "$OUT/topk.txt" | head -14
    for o in 0 8192; do
      timeout 120 python3 benches/gpu/flash_slice.py --slice v41 --cells 1x2048 --prefill , --kv-cache-dtype fp8 \
        --set v41.kernels.topk.ORDERED_MAX_N=$o --out "$OUT/fs_o$o" > "$OUT/fs_v41_o$o.txt" 2>&1
      echo "ORDERED_MAX_N=$o: $(grep "'v41'" "$OUT/fs_v41_o$o.txt" | tail -1 | cut -c1-90)"
    done ;;
  side)
    timeout 60 $PT tests/test_gpu_side_stream.py > "$OUT/tests18.txt" 2>&1 || rc=1
    tail -2 "$OUT/tests18.txt"
    # steps of 8 and 64 tokens inline (side_stream.MAX_TOKENS = 1) and on the side stream (64); one-token
    # steps take it either way (measured on 2026-12-05: 5.8 % faster on the H100)
    for most in 1 64; do
      timeout 150 python3 benches/gpu/flash_slice.py --slice v41 --cells 8x2048,64x2048 --prefill , \
        --kv-cache-dtype fp8 --set v41.kernels.side_stream.MAX_TOKENS=$most --out "$OUT/fs_side_$most" \
        > "$OUT/fs_v41_side_$most.txt" 2>&1
      echo "side stream for steps of at most $most tokens:"; grep "'v41'" "$OUT/fs_v41_side_$most.txt" | cut -c1-90
    done ;;
  hf)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hf .hfwhl/*.whl
    PYTHONPATH=/tmp/hf:$PYTHONPATH timeout 280 python3 benches/gpu/flash_slice.py --slice v4 --cells 1x2048,8x2048 \
      --prefill 2048 --transformers --out "$OUT/fs_hf" > "$OUT/fs_v4_hf.txt" 2>&1
    tail -5 "$OUT/fs_v4_hf.txt" ;;
  wide)
    timeout 100 $PT tests/test_gpu_fast.py -k "triton_kernel_equals and attention and bf16" > "$OUT/tests17.txt" 2>&1 \
      || rc=1
    tail -3 "$OUT/tests17.txt"
    timeout 150 python3 benches/gpu/kernel_bench.py --ops attention --batches 1,8,64 --reps 12 > "$OUT/wide.txt" 2>&1
    grep "sparse MQA\|^| op" "$OUT/wide.txt"
    for w in 0 256; do
      timeout 100 python3 benches/gpu/flash_slice.py --slice v41 --cells , --prefill 8192 --kv-cache-dtype auto \
        --set v41.kernels.sparse_attention.WIDE_MIN_TOKENS=$w --out "$OUT/fs_w$w" > "$OUT/fs_w$w.txt" 2>&1
      echo "WIDE_MIN_TOKENS=$w: $(grep "prefill" "$OUT/fs_w$w.txt" | tail -1)"
    done ;;
esac
done
exit $rc
