"""The embedded model's training curve as an SVG (no plotting library needed), for benches/RESULTS.md.

    python benches/plot_training.py python/v41/embedded/train_log.json benches/train_tiny_loss.svg

Plots the training loss (mean of every 20 steps) and the held-out loss points of ``train_log.json`` (written by
``python -m v41.testing.train``) against the optimizer step, with the uniform-distribution line ln(vocab).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

W, H, PAD = 640, 360, 48


def polyline(points, xmax, ymax, color, dots=False) -> str:
    def xy(x, y):
        return PAD + x / xmax * (W - 2 * PAD), H - PAD - min(y, ymax) / ymax * (H - 2 * PAD)
    coords = [xy(x, y) for x, y in points]
    if dots:
        return "".join(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>' for a, b in coords)
    path = " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>'


def render(log: dict) -> str:
    curve = log["curve"]
    steps = len(curve)
    train = [(i + 10, sum(p["loss"] for p in curve[i:i + 20]) / len(curve[i:i + 20])) for i in range(0, steps, 20)]
    held = [(0, log["heldout_loss_init"])] + [(p["step"], p["heldout_loss"]) for p in curve if "heldout_loss" in p]
    ymax, uniform = 8.0, log["uniform_loss"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>']
    for y in range(0, 9, 2):
        yy = H - PAD - y / ymax * (H - 2 * PAD)
        parts.append(f'<line x1="{PAD}" x2="{W - PAD}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>'
                     f'<text x="{PAD - 8}" y="{yy + 4:.1f}" text-anchor="end">{y}</text>')
    for x in range(0, steps + 1, max(1, steps // 5)):
        xx = PAD + x / steps * (W - 2 * PAD)
        parts.append(f'<text x="{xx:.1f}" y="{H - PAD + 16}" text-anchor="middle">{x}</text>')
    parts.append(polyline([(0, uniform), (steps, uniform)], steps, ymax, "#999"))
    parts.append(polyline(train, steps, ymax, "#1f77b4"))
    parts.append(polyline(held, steps, ymax, "#d62728") + polyline(held, steps, ymax, "#d62728", dots=True))
    parts.append(f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">optimizer step</text>'
                 f'<text x="{PAD}" y="20">loss (nats / token): training (mean of 20 steps, blue), held-out (red), '
                 f'uniform ln(vocab) = {uniform:.2f} (grey); off the chart above 8</text></svg>')
    return "".join(parts)


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(render(json.loads(Path(sys.argv[1]).read_text())) + "\n")
