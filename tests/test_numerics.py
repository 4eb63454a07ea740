"""Numerics of the reference model (docs/model.md §2, §3.4 mHC, §3.5/§3.6 visibility and sinks, §3.8
router; docs/numerics.md §4 numerics contract; docs/known-failures.md KF-22).

Expected values come from independent slow implementations written here with explicit Python loops, or
from properties (causality, tie order) that do not depend on the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from v41.models.reference import load
from v41.models.reference.moe import Gate, route
from v41.models.reference.ops import hc_mixes, sink_attention, stable_topk
from v41.testing.tiny import make_tiny

V41, V4 = "deepseek_v41", "deepseek_v4"
PROMPT_LEN = 40


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch) for arch in (V41, V4)}


def _prompt(seed: int = 0, n: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1024, (n,), generator=g)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-position ‖a − b‖₂ / ‖b‖₂ (docs/numerics.md §4) over the last dim."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


# --------------------------------------------------------------------------------------------------
# mHC (§3.4) against an independent loop implementation
# --------------------------------------------------------------------------------------------------


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _mixes_by_hand(h, fn, scale, base, hc, iters, hc_eps, norm_eps):
    """§3.4 for one token, plain Python floats: returns (pre[hc], post[hc], C[hc][hc])."""
    x = [float(v) for row in h for v in row]  # flatten(H), copy-major
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + norm_eps)
    m = [sum(fn[k][j] * x[j] for j in range(len(x))) * r for k in range((2 + hc) * hc)]
    pre = [_sigmoid(m[i] * scale[0] + base[i]) + hc_eps for i in range(hc)]
    post = [2 * _sigmoid(m[hc + i] * scale[1] + base[hc + i]) for i in range(hc)]
    c = [[m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] for j in range(hc)] for i in range(hc)]
    for i in range(hc):  # softmax over j (each row i), then + eps
        mx = max(c[i])
        e = [math.exp(v - mx) for v in c[i]]
        s = sum(e)
        c[i] = [v / s + hc_eps for v in e]

    def col_norm():
        for j in range(hc):
            s = sum(c[i][j] for i in range(hc))
            for i in range(hc):
                c[i][j] /= s + hc_eps

    def row_norm():
        for i in range(hc):
            s = sum(c[i])
            c[i] = [v / (s + hc_eps) for v in c[i]]

    col_norm()
    for _ in range(iters - 1):
        row_norm()
        col_norm()
    return pre, post, c


def _mhc_inputs(peaked: bool, seed: int = 0, t: int = 3, hc: int = 4, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hc, d, generator=g, dtype=torch.float64)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g, dtype=torch.float64) * 0.1
    scale = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    base = torch.randn((2 + hc) * hc, generator=g, dtype=torch.float64) * 0.3
    if peaked:
        # rows 0 and 1 both want output copy 0, rows 2/3 want copies 1/2: no column wants copy 3, so
        # Sinkhorn converges slowly and 20 fixed iterations leave it visibly not doubly stochastic.
        peak = torch.full((hc, hc), -30.0, dtype=torch.float64)
        peak[0, 0] = peak[1, 0] = peak[2, 1] = peak[3, 2] = 30.0
        base[2 * hc:] = peak.flatten()
        fn[2 * hc:] *= 0.01
    return h, fn, scale, base


@pytest.mark.parametrize("peaked", [False, True], ids=["random", "peaked"])
def test_hc_mixes_matches_independent_sinkhorn(peaked):
    hc, iters, hc_eps, norm_eps = 4, 20, 1e-6, 1e-20
    h, fn, scale, base = _mhc_inputs(peaked)
    pre, post, comb = hc_mixes(h, fn, scale, base, hc, iters, hc_eps, norm_eps)
    assert pre.dtype == post.dtype == comb.dtype == torch.float64
    for t in range(h.shape[0]):
        e_pre, e_post, e_c = _mixes_by_hand(h[t].tolist(), fn.tolist(), scale.tolist(), base.tolist(),
                                            hc, iters, hc_eps, norm_eps)
        torch.testing.assert_close(pre[t], torch.tensor(e_pre, dtype=torch.float64), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(post[t], torch.tensor(e_post, dtype=torch.float64), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(comb[t], torch.tensor(e_c, dtype=torch.float64), rtol=1e-10, atol=1e-15)
    row_err = (comb.sum(-1) - 1).abs().max().item()
    if peaked:  # fixed iterations, not an ideal projection (docs/numerics.md §4)
        assert row_err > 1e-2
    else:  # mild logits converge within the 20 iterations
        assert row_err < 1e-5  # up to the hc_eps terms
    assert (comb.sum(-2) - 1).abs().max().item() < 1e-5  # the last step normalizes columns


def test_hc_mixes_float32_follows_float64():
    h, fn, scale, base = _mhc_inputs(peaked=False, seed=3)
    ref = hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-20)
    got = hc_mixes(h.float(), fn.float(), scale.float(), base.float(), 4, 20, 1e-6, 1e-20)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# visibility of compressed entries (§3.6, §4): entry j visible iff j < (p+1)//r
# --------------------------------------------------------------------------------------------------


def _capture_compressed_visibility(model, ids: torch.Tensor, monkeypatch) -> dict[int, torch.Tensor]:
    """Run a whole-sequence forward and return, per compressed layer, the [T, N] visibility of the
    compressed keys that the layer's attention used."""
    seen: dict[int, torch.Tensor] = {}
    for plan, layer in zip(model.cfg.plan, model.layers):
        if plan.ratio == 0:
            continue
        orig = layer.attn.compressed

        def spy(x, qr, ctx, _orig=orig, _lid=plan.layer_id):
            out = _orig(x, qr, ctx)
            seen[_lid] = out[1].clone()
            return out

        monkeypatch.setattr(layer.attn, "compressed", spy)
    model(ids.view(1, -1))
    return seen


@pytest.mark.parametrize("arch", [V41, V4])
def test_compressed_entry_visible_only_if_its_group_is_closed(ckpts, arch, monkeypatch):
    model = load(ckpts[arch])
    cfg = model.cfg
    seen = _capture_compressed_visibility(model, _prompt(), monkeypatch)
    ratios = set()
    p = torch.arange(PROMPT_LEN)
    for plan in cfg.plan:
        if plan.ratio == 0:
            continue
        r = plan.ratio
        ratios.add(r)
        vis = seen[plan.layer_id]
        assert vis.shape == (PROMPT_LEN, PROMPT_LEN // r), plan
        allowed = torch.arange(PROMPT_LEN // r)[None, :] < ((p + 1) // r)[:, None]
        assert not (vis & ~allowed).any(), f"layer {plan.layer_id} (ratio {r}) sees an open group"
        n_t = ((p + 1) // r).clamp(max=cfg.index_topk)
        if plan.attn_type == "hca":  # attends every closed entry
            assert torch.equal(vis, allowed), plan
        elif cfg.plan[plan.idx_src].uses_candidate_filter:  # candidates may drop visible entries
            assert (vis.sum(1) <= n_t).all(), plan
        else:  # every visible entry has a finite index score, so top-k takes min(k, visible) of them
            assert torch.equal(vis.sum(1), n_t), plan
    assert ratios == ({1, 2} if cfg.is_v41 else {4, 8})


@pytest.mark.parametrize("arch", [V41, V4])
def test_logits_are_causal(ckpts, arch):
    """Changing tokens after p never changes logits at ≤ p (a compressed entry whose group is still open, an
    Engram n-gram or a window row from the future would leak)."""
    model = load(ckpts[arch], dtype=torch.float64)
    ids = _prompt()
    base = model(ids.view(1, -1))[0]
    g = torch.Generator().manual_seed(1)
    for p in range(1, PROMPT_LEN - 1, 3):  # every residue mod 8 (ratios 1, 2, 4, 8)
        changed = ids.clone()
        changed[p + 1:] = torch.randint(3, 1024, (PROMPT_LEN - p - 1,), generator=g)
        out = model(changed.view(1, -1))[0]
        torch.testing.assert_close(out[: p + 1], base[: p + 1], rtol=1e-9, atol=1e-9,
                                   msg=lambda m, p=p: f"logits at <= {p} depend on later tokens: {m}")
        assert not torch.allclose(out[p + 1:], base[p + 1:])


# --------------------------------------------------------------------------------------------------
# router (§3.8, docs/numerics.md §4, KF-22)
# --------------------------------------------------------------------------------------------------


def _gate(weight: torch.Tensor, top_k: int, bias: torch.Tensor | None = None) -> Gate:
    g = Gate(weight.shape[1], weight.shape[0], top_k)
    with torch.no_grad():
        g.weight.copy_(weight)
        if bias is not None:
            g.bias.copy_(bias)
    return g


def _route(gate, x, **kw):
    kw = {"gate_temp": 1.0, "norm_topk_prob": True, "scaling": 1.5, **kw}
    return route(gate, x, torch.zeros(x.shape[0], dtype=torch.long), **kw)


@pytest.mark.parametrize("gate_temp", [1.0, 0.5])
def test_router_finite_for_logits_in_pm200(gate_temp):
    n_exp, k = 16, 4
    w = torch.zeros(n_exp, 2)
    w[:, 0] = torch.linspace(-200, 200, n_exp)  # x = [1, 0] -> logits span [-200, 200]
    w[:, 1] = -200.0 - torch.arange(n_exp, dtype=torch.float32)  # x = [0, 1] -> every score underflows
    bias = torch.linspace(-0.3, 0.3, n_exp)
    gate = _gate(w, k, bias)
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [0.0, 1.0]])
    logits = x @ w.T
    assert logits.min() <= -200 and logits.max() >= 200
    ids, weights = _route(gate, x, gate_temp=gate_temp)
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    assert ids.shape == weights.shape == (4, k)
    scores = torch.sqrt(torch.nn.functional.softplus(logits[3] / gate_temp))
    assert (scores == 0).all()  # sqrt(softplus) underflows for the last row in float32 ...
    # ... but the router keeps log-scores, so its renormalized weights are still exact (docs/numerics.md §4):
    torch.testing.assert_close(weights.sum(-1), torch.full((4,), 1.5))
    picked = (logits[3] / gate_temp)[ids[3]].double() / 2  # log s = x / 2 that far down
    want = torch.softmax(picked, -1) * 1.5
    torch.testing.assert_close(weights[3].double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("value", [-1000.0, -200.0, -104.0, -20.0, 0.0, 30.0, 1000.0])
def test_router_rows_of_identical_logits_get_equal_weights_at_any_value(value):
    """Issue 13 item 5: the weights of a row of identical logits are equal (1.5 / k each) over the float32
    range, in the oracle and in the fast model's router kernel (its PyTorch reference here)."""
    from v41.kernels.router import route_ref

    n_exp, k = 8, 4
    gate = _gate(torch.zeros(n_exp, 1), k, torch.linspace(0, 0.1, n_exp))
    x = torch.tensor([[1.0]])
    gate.weight.data[:] = value
    ids, weights = _route(gate, x)
    torch.testing.assert_close(weights, torch.full((1, k), 1.5 / k))
    fids, fweights = route_ref(torch.full((1, n_exp), value), gate.bias.data, None, k, 1.0, True, 1.5)
    assert torch.equal(fids, ids)
    torch.testing.assert_close(fweights, torch.full((1, k), 1.5 / k))


def test_router_identical_logits_give_equal_weights():
    gate = _gate(torch.ones(8, 4) * 0.25, top_k=3)
    ids, weights = _route(gate, torch.randn(5, 4))
    assert torch.equal(ids, torch.tensor([[0, 1, 2]] * 5))
    assert (weights == weights[:, :1]).all()
    torch.testing.assert_close(weights, torch.full((5, 3), 0.5))


def _expected_topk(sel: list[float], k: int) -> list[int]:
    """Independent tie rule: descending score, exact ties to the lower expert id."""
    return sorted(range(len(sel)), key=lambda e: (-sel[e], e))[:k]


def test_kf22_moe_topk_stable_ties():
    n_exp, k = 16, 4
    gate = _gate(torch.eye(n_exp), k)  # logits == x exactly
    rows = torch.full((6, n_exp), -1.0)
    rows[0] = 0.0  # everything tied
    rows[1, 9] = 3.0
    rows[1, [14, 5, 11, 2]] = 1.0  # 4 tied for 3 places -> 2, 5, 11
    rows[2, [15, 0]] = 2.0
    rows[2, [12, 7, 3]] = 1.5  # -> 0, 15, 3, 7
    rows[3, [13, 6, 1]] = 0.7  # tie straddles the k-th place after 3 distinct leaders
    rows[3, [4, 8, 10]] = torch.tensor([2.0, 1.5, 1.0])
    rows[4, 1:] = 0.25  # expert 0 alone below a 15-way tie
    rows[5] = torch.tensor([1.0, 0.5] * 8)  # 8 tied at the top
    first_ids, first_w = _route(gate, rows)
    for _ in range(20):
        ids, w = _route(gate, rows)
        assert torch.equal(ids, first_ids) and torch.equal(w, first_w)
    sel = torch.sqrt(torch.nn.functional.softplus(rows))
    for r in range(rows.shape[0]):
        want = _expected_topk(sel[r].tolist(), k)
        assert first_ids[r].tolist() == want, r
        picked = sel[r, first_ids[r]]
        assert (picked[:-1] >= picked[1:]).all()  # descending score order
    assert first_ids[1].tolist() == [9, 2, 5, 11]
    assert first_ids[2].tolist() == [0, 15, 3, 7]
    # a row's choice does not depend on the batch it is routed in
    for r in range(rows.shape[0]):
        assert torch.equal(_route(gate, rows[r:r + 1])[0][0], first_ids[r])


def test_stable_topk_ties_go_to_lower_index_whatever_the_length():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert stable_topk(s, 2).tolist() == [[1, 2], [0, 1]]
    assert stable_topk(s, 4).tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    long = torch.zeros(3, 5000)
    long[:, 4321] = -1.0
    assert stable_topk(long, 7).tolist() == [list(range(7))] * 3
    padded = torch.cat([s, torch.full((2, 3000), float("-inf"))], dim=1)
    assert torch.equal(stable_topk(padded, 4), stable_topk(s, 4))


# --------------------------------------------------------------------------------------------------
# attention sink (§2, §3.5)
# --------------------------------------------------------------------------------------------------


def _sink_attention_by_hand(q, keys, visible, sink, scale):
    t_n, h_n, d = q.shape
    out = torch.zeros(t_n, h_n, d, dtype=torch.float64)
    for t in range(t_n):
        for h in range(h_n):
            logits = {s: sum(q[t, h, i].item() * keys[s, i].item() for i in range(d)) * scale
                      for s in range(keys.shape[0]) if visible[t, s]}
            a = sink[h].item()  # not multiplied by the softmax scale
            mx = max(list(logits.values()) + [a])
            denom = sum(math.exp(v - mx) for v in logits.values()) + math.exp(a - mx)
            for s, v in logits.items():  # the sink has no value row
                out[t, h] += math.exp(v - mx) / denom * keys[s].double()
    return out


def test_sink_attention_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    keys = torch.randn(6, 8, generator=g, dtype=torch.float64)
    visible = torch.tensor([[0, 0, 0, 0, 0, 0],  # nothing visible: zeros
                            [1, 0, 0, 0, 0, 0],
                            [1, 1, 0, 1, 0, 0],
                            [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    sink = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    scale = 8 ** -0.5
    got = sink_attention(q, keys, visible, sink, scale)
    want = _sink_attention_by_hand(q, keys, visible, sink, scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(got[0], torch.zeros(3, 8, dtype=torch.float64))
    # the sink only shrinks the weights: one visible key -> o = k / (1 + exp(a − l))
    l1 = (q[1] @ keys[0]) * scale
    torch.testing.assert_close(got[1], keys[0][None, :] / (1 + torch.exp(sink - l1))[:, None], rtol=1e-12, atol=0)


def test_sink_attention_no_visible_keys_is_zero_not_nan_float32():
    q, keys = torch.randn(2, 4, 16), torch.randn(3, 16)
    got = sink_attention(q, keys, torch.zeros(2, 3, dtype=torch.bool), torch.randn(4), 0.25)
    assert torch.equal(got, torch.zeros(2, 4, 16))


# --------------------------------------------------------------------------------------------------
# whole model: float64 vs float32 exact, deployed vs exact
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [V41, V4])
def test_float32_exact_agrees_with_float64_to_1e4(ckpts, arch):
    ids = _prompt().view(1, -1)
    l32 = load(ckpts[arch], dtype=torch.float32)(ids)[0]
    l64 = load(ckpts[arch], dtype=torch.float64)(ids)[0]
    rel = _rel_l2(l32.double(), l64)
    print(f"{arch}: float32 vs float64 exact, max rel L2 {rel.max().item():.2e}")
    assert rel.max().item() <= 1e-4


# Deployed vs exact. FP8 E4M3 activations carry ~2.6% relative rounding per element (3 mantissa bits,
# power-of-two block scale), the window KV the same, compressed KV / index keys FP4 (far coarser). In the
# tiny random models those errors are amplified through 12 (V4.1) / 6 (V4) mHC blocks: with dense routing
# and selection (top-k = everything, so nothing discrete can flip) we measured max 0.20 (V4.1) / 0.15 (V4)
# relative L2 per position at seed 0 (0.26 / 0.20 worst over seeds 0-3), and a random 1% multiplicative
# perturbation at the same points gives 0.07, i.e. the model gain is ~7x. Bound: 0.4 max, 0.2 mean.
# With the default sparse routing (top-2 of 8 experts, top-6 index entries) a 2.6% rounding flips discrete
# choices and whole expert outputs change: measured max 0.85 / 0.50, mean 0.41 / 0.13. There we assert
# finite logits and a clear gap to unrelated logits (relative L2 ~ sqrt(2) for equal norms): max 1.2, mean 0.6.
DENSE = {V41: dict(num_experts_per_tok=8, index_topk=64, candidate_topk_blocks=17),
         V4: dict(num_experts_per_tok=8, index_topk=64)}


@pytest.mark.parametrize("arch", [V41, V4])
def test_deployed_numerics_within_bound_of_exact_with_dense_routing(tmp_path, arch):
    path = make_tiny(tmp_path / arch, arch, **DENSE[arch])
    ids = _prompt().view(1, -1)
    exact = load(path)(ids)[0]
    deployed = load(path, numerics="deployed")(ids)[0]
    assert torch.isfinite(deployed).all()
    rel = _rel_l2(deployed, exact)
    print(f"{arch} dense routing: deployed vs exact rel L2 max {rel.max().item():.3f} mean {rel.mean().item():.3f}")
    assert rel.min().item() > 1e-4  # deployed really quantizes
    assert rel.max().item() <= 0.4 and rel.mean().item() <= 0.2


@pytest.mark.parametrize("arch", [V41, V4])
def test_deployed_numerics_finite_and_bounded_default_tiny(ckpts, arch):
    ids = _prompt().view(1, -1)
    exact = load(ckpts[arch])(ids)[0]
    deployed = load(ckpts[arch], numerics="deployed")(ids)[0]
    assert torch.isfinite(deployed).all()
    rel = _rel_l2(deployed, exact)
    print(f"{arch} default: deployed vs exact rel L2 max {rel.max().item():.3f} mean {rel.mean().item():.3f}")
    assert rel.min().item() > 1e-4
    assert rel.max().item() <= 1.2 and rel.mean().item() <= 0.6
