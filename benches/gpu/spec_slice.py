"""DSpark draft and verify steps at V4.1-Flash dimensions (issue 15): flash-slice-v41 (``flash_slice.py``) extended
with the 3 drafter stages at real size (``mtp.0..2``: 128 experts top-3 + shared, Markov rank 256, the target's LM
head) fed by the slice's last three layers, random weights, checkpoint formats, CUDA graphs.

    python3 benches/gpu/spec_slice.py [--batches 1 8 64] [--out DIR] [--linear-max-m 512]

The engine starts with ``{"num_speculative_tokens": 5, "enable_adaptive_verification": true}``, so it captures a
verify graph set per query-token count q = 1..6 and profiles them (``engine/adaptive_verify.py``): seconds of a
verify step of B requests × q tokens and of a draft pass of B requests, on padded inputs with random token ids
(context 0: every slot −1, so the figures are the steps' weight traffic plus launch and host costs; the
flash-slice decode cells give the KV reads at 2k context). Floors = the bytes each step must read over the
device-to-device copy bandwidth measured in the same call: a verify step reads the target's dense weights, the
routed experts its B·q tokens touch (uniform routing expectation) and the LM head; a draft pass reads the
drafter's dense weights, the experts its B·5 block rows touch, the LM head and the Markov head. Projected decode
tokens/s at K = the acceptance the trained tiny drafter measured (``python/v41/embedded/acceptance.json``,
greedy): ``B · (1 + Σ_{i<K} accepted_i) / (draft + verify(B, 1 + K))`` against plain ``B / verify(B, 1)``.
Prints the environment, writes JSON to --out, one table last.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from flash_slice import V41_FLASH_SLICE, ceilings
from layer_times import is_routed_expert

DRAFTER = dict(num_nextn_predict_layers=3, dspark_block_size=5, dspark_target_layer_ids=[6, 7, 8],
               compress_ratios=V41_FLASH_SLICE["compress_ratios"] + [0, 0, 0],
               dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_num_experts_per_tok=3)
ACCEPTANCE = Path(__file__).resolve().parents[2] / "python/v41/embedded/acceptance.json"


def split_bytes(model) -> dict:
    """Weight bytes: target dense, one target routed expert, drafter dense, one drafter expert, LM head."""
    out = dict(dense=0, expert=0, d_dense=0, d_expert=0)
    for name, t in list(model.named_buffers()) + list(model.named_parameters()):
        n = t.numel() * t.element_size()
        if name.startswith("head.") or name.startswith("embed.") or ".engram.table" in name:
            continue
        key = ("d_" if name.startswith("drafter.") else "") + ("expert" if is_routed_expert(name) else "dense")
        out[key] += n
    cfg = model.cfg
    out["expert"] /= len(model.layers) * cfg.n_routed_experts
    out["d_expert"] /= cfg.num_nextn_predict_layers * cfg.dspark_n_routed_experts
    out["head"] = model.head.proj.packed.nbytes
    return out


def touched(experts: int, top_k: int, tokens: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** tokens)


def floors_ms(wb: dict, cfg, batch: int, q: int, gbps: float) -> tuple[float, float]:
    """(verify floor of B × q tokens, draft floor of B requests) in ms."""
    verify = (wb["dense"] + len(cfg.plan) * touched(cfg.n_routed_experts, cfg.num_experts_per_tok, batch * q)
              * wb["expert"] + wb["head"])
    rows = batch * cfg.dspark_block_size
    draft = (wb["d_dense"] + cfg.num_nextn_predict_layers * wb["d_expert"]
             * touched(cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok, rows) + wb["head"])
    return 1e3 * verify / (gbps * 1e9), 1e3 * draft / (gbps * 1e9)


def main() -> None:
    from v41.engine.args import EngineArgs
    from v41.engine.core import EngineCore
    from v41.testing.tiny import make_tiny

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--linear-max-m", type=int, default=None,
                    help="rows up to which dense linears take the Triton kernel (kernels/linear.py TRITON_MAX_M)")
    a = ap.parse_args()
    if a.linear_max_m is not None:
        import v41.kernels.linear as linear
        linear.TRITON_MAX_M = a.linear_max_m
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("V41_COMMIT", "?")}
    env.update(ceilings("cuda"))
    print("environment:", json.dumps(env), flush=True)
    path = make_tiny(Path(tempfile.mkdtemp()) / "flash-slice-v41-dspark", "deepseek_v41", weights=False,
                     **{**V41_FLASH_SLICE, **DRAFTER})
    k = DRAFTER["dspark_block_size"]
    args = EngineArgs(model=str(path), load_format="dummy", device="cuda", max_num_seqs=max(a.batches),
                      max_num_batched_tokens=1024, max_model_len=4096, enable_prefix_caching=False,
                      num_kv_blocks=256, speculative_config={"num_speculative_tokens": k,
                                                             "enable_adaptive_verification": True})
    t = time.perf_counter()
    core = EngineCore(args)
    print(f"engine ready in {time.perf_counter() - t:.0f} s (graphs captured, profile taken)", flush=True)
    runner = core.executor.runner
    costs, cfg = runner.verify_costs, core.cfg
    wb = split_bytes(runner.model)
    accepted = json.loads(ACCEPTANCE.read_text())["greedy"]["per_position"]
    rows = []
    for b in a.batches:
        i = costs.sizes.index(b)
        draft_ms = 1e3 * costs.draft_s[i]
        plain_tps = b / costs.verify_s[i, 0]
        for q in range(1, k + 2):
            v_floor, d_floor = floors_ms(wb, cfg, b, q, env["copy_GBps"])
            verify_ms = 1e3 * costs.verify_s[i, q - 1]
            kk = q - 1
            tps = b * (1 + sum(accepted[:kk])) / ((draft_ms + verify_ms) / 1e3) if kk else plain_tps
            rows.append(dict(batch=b, q=q, verify_ms=verify_ms, verify_floor_ms=v_floor, draft_ms=draft_ms,
                             draft_floor_ms=d_floor, projected_tps=tps, plain_tps=plain_tps))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "spec_slice.json").write_text(json.dumps({"env": env, "weights": wb, "rows": rows,
                                                             "profile": costs.table(), "acceptance": accepted}))
    print("\nprofile (all sizes):\n" + costs.table())
    print(f"\nflash-slice-v41 + DSpark drafter ({env['gpu']}; copy {env['copy_GBps']:.0f} GB/s); context 0; "
          f"projection at the tiny drafter's greedy acceptance {accepted}")
    print(f"{'B':>3} {'K':>2} {'verify ms':>10} {'floor':>7} {'ratio':>6} {'draft ms':>9} {'floor':>7} {'ratio':>6} "
          f"{'proj tok/s':>11} {'vs plain':>8}")
    for r in rows:
        print(f"{r['batch']:>3} {r['q'] - 1:>2} {r['verify_ms']:>10.3f} {r['verify_floor_ms']:>7.3f} "
              f"{r['verify_ms'] / r['verify_floor_ms']:>5.2f}x {r['draft_ms']:>9.3f} {r['draft_floor_ms']:>7.3f} "
              f"{r['draft_ms'] / r['draft_floor_ms']:>5.2f}x {r['projected_tps']:>11.0f} "
              f"{r['projected_tps'] / r['plain_tps']:>7.2f}x")


if __name__ == "__main__":
    main()
