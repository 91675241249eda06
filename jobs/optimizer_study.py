"""What Tail's compression error does to the optimizer's step, per layer (open loop).

    python -m jobs.optimizer_study [--models digits_cnn,char_transformer] [--steps N] [--keep K]
                                   [--tail-variant JSON] [--json PATH]

Error feedback makes the SUM of the gradients Tail delivers over steps equal the sum of the true
ones (up to the residual still held back). An optimizer that is linear in the gradient (SGD
with momentum: digits) then takes the same steps on average. Adam is not linear: its second
moment v is the mean of the SQUARED gradient, and the compression error adds its own square to
it, so ``m / sqrt(v)`` shrinks wherever that error is large against the gradient, as if that
coordinate's learning rate were cut. This study measures how much.

It trains each model with 2 simulated workers (``jobs.bench_codec``'s capture, the true mean
gradient, the model's own optimizer), and over the last ``--keep`` steps feeds two shadow
copies of the model's parameters, each with the model's own optimizer class and settings:

  true   the mean of the workers' gradients (what ``none`` averages)
  tail   the mean Tail delivers (one TailCompressor per worker, every payload aggregated)

Both shadows start from the same weights; the gradients are those of the true trajectory (open
loop: the study shows what the optimizer does with Tail's gradients, not where training then
goes). Per layer and over the model it prints:

  step along true   <u_tail, u_true> / <u_true, u_true> over the kept steps (u: a shadow's
                    parameter change in one step): 1.0 = the true step's length along its own
                    direction; 0.93 = as if the learning rate were 7 % lower
  cos               the cosine between the two steps, over the kept steps
  v tail / v true   (Adam only) the median over coordinates of the two second moments at
                    the end, and its 90th percentile
  traffic           the mean payload a worker sent per kept step, and fp32's size over it:
                    what a variant's step costs, so two variants can be weighed

Figures and what they mean: docs/engine.md, "Tail and Adam's second moment".
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from jobs.bench_codec import MODELS, add_capture_args, capture_gradients, models_of, run_step
from jobs.output_path import output_file
from tail_ray.compression.base import Compressor
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.errors import ConfigError

WORLD = 2  # simulated workers, as in the other offline studies


@dataclass
class LayerStep:
    layer: str
    numel: int
    along: float  # <u_tail, u_true> / <u_true, u_true>, summed over the kept steps
    cos: float  # <u_tail, u_true> / (|u_tail| |u_true|), summed over the kept steps
    v_median: float | None  # Adam: median over coordinates of v_tail / v_true at the end
    v_p90: float | None


class _Shadow:
    """A copy of the parameters and an optimizer of the model's own class and settings."""

    def __init__(self, model_name: str, params: dict[str, torch.Tensor]) -> None:
        self.params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
        module = torch.nn.Module()
        for i, p in enumerate(self.params.values()):
            module.register_parameter(f"p{i}", p)
        self.opt = MODELS[model_name][2](module)

    def step(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One optimizer step on ``grads``; the parameter change per layer."""
        before = {n: p.detach().clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.grad = grads[n]  # fresh tensors each step: the optimizer only reads them
        self.opt.step()
        return {n: p.detach() - before[n] for n, p in self.params.items()}

    def second_moment(self, name: str) -> torch.Tensor | None:
        state = self.opt.state.get(self.params[name], {})
        v = state.get("exp_avg_sq")
        return v if isinstance(v, torch.Tensor) else None


def study_model(model_name: str, steps: int, keep: int, config: TailConfig, seed: int) -> dict[str, Any]:
    """Capture ``steps`` steps, then run both shadows over the last ``keep`` (module docstring)."""
    cap = capture_gradients(model_name, steps, keep, WORLD, seed=seed, keep_weights=True)
    assert cap.weights is not None
    comps: list[Compressor] = [TailCompressor(config) for _ in range(WORLD)]
    true_shadow, tail_shadow = _Shadow(model_name, cap.weights), _Shadow(model_name, cap.weights)
    for comp in comps:  # the budget a trainer on this optimizer gets (bitwidth/policy.py)
        comp.set_linear_optimizer(cap.linear)
    names = list(cap.grads[0][0])
    dot = dict.fromkeys(names, 0.0)
    true_sq = dict.fromkeys(names, 0.0)
    tail_sq = dict.fromkeys(names, 0.0)
    sizes: list[int] = []
    for per_rank in cap.grads:
        delivered = run_step(comps, per_rank, cap.lr, sizes)
        true_mean = {n: torch.stack([r[n] for r in per_rank]).mean(0) for n in names}
        u_true, u_tail = true_shadow.step(true_mean), tail_shadow.step(delivered)
        for n in names:
            dot[n] += float(torch.dot(u_tail[n].flatten().double(), u_true[n].flatten().double()))
            true_sq[n] += float(u_true[n].double().square().sum())
            tail_sq[n] += float(u_tail[n].double().square().sum())
    layers = [
        _layer_row(n, cap.grads[0][0][n].numel(), dot, true_sq, tail_sq, true_shadow, tail_shadow)
        for n in names
    ]
    total = {
        "along": sum(dot.values()) / max(sum(true_sq.values()), 1e-300),
        "cos": sum(dot.values()) / max(np.sqrt(sum(true_sq.values()) * sum(tail_sq.values())), 1e-300),
    }
    return {
        "model": model_name,
        "optimizer": type(true_shadow.opt).__name__,
        "steps": steps,
        "keep": keep,
        "model_step": total,
        # What that step cost: the mean payload a worker sent per step, and fp32's over it.
        "payload_bytes_per_step": float(np.mean(sizes)),
        "ratio": 4 * sum(cap.grads[0][0][n].numel() for n in names) / float(np.mean(sizes)),
        "layers": [asdict(r) for r in layers],
    }


def _layer_row(
    name: str,
    numel: int,
    dot: dict[str, float],
    true_sq: dict[str, float],
    tail_sq: dict[str, float],
    true_shadow: _Shadow,
    tail_shadow: _Shadow,
) -> LayerStep:
    along = dot[name] / true_sq[name] if true_sq[name] > 0 else 1.0
    norm = np.sqrt(true_sq[name] * tail_sq[name])
    cos = dot[name] / norm if norm > 0 else 1.0
    v_true, v_tail = true_shadow.second_moment(name), tail_shadow.second_moment(name)
    v_median = v_p90 = None
    if v_true is not None and v_tail is not None:
        seen = v_true > 0  # coordinates with no true gradient yet (unused embedding rows) say nothing
        if bool(seen.any()):
            ratio = (v_tail[seen] / v_true[seen]).double().numpy()
            v_median, v_p90 = float(np.median(ratio)), float(np.percentile(ratio, 90))
    return LayerStep(name, numel, along, cos, v_median, v_p90)


def print_report(res: dict[str, Any]) -> None:
    print(
        f"\n== {res['model']} ({res['optimizer']}; Tail over the last {res['keep']} of {res['steps']} "
        f"steps, {WORLD} workers, open loop)"
    )
    print(
        f"{'layer':44s} {'numel':>8s} {'step along true':>16s} {'cos':>6s} {'v tail/v true':>14s} {'p90':>6s}"
    )
    for r in res["layers"]:
        v = "-" if r["v_median"] is None else f"{r['v_median']:.3f}"
        p90 = "-" if r["v_p90"] is None else f"{r['v_p90']:.2f}"
        print(f"{r['layer']:44s} {r['numel']:8d} {r['along']:16.3f} {r['cos']:6.3f} {v:>14s} {p90:>6s}")
    t = res["model_step"]
    print(f"{'whole model':44s} {'':8s} {t['along']:16.3f} {t['cos']:6.3f}")
    sent = res["payload_bytes_per_step"]
    print(f"traffic: {sent:,.0f} B per worker per step ({res['ratio']:.2f}x less than fp32)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.optimizer_study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_capture_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="data / model seed (default %(default)s)")
    parser.add_argument(
        "--tail-variant",
        default="{}",
        metavar="JSON",
        help="TailConfig settings, e.g. '{\"small_layer_bits\": 32}'",
    )
    parser.add_argument("--json", type=output_file, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    models = models_of(parser, args.models)
    if not 1 <= args.keep <= args.steps:
        parser.error("need 1 <= --keep <= --steps")
    try:
        variant = json.loads(args.tail_variant)
        if not isinstance(variant, dict):
            raise ValueError("not a JSON object")
        config = TailConfig(**variant)
    except (ValueError, TypeError, ConfigError) as exc:
        parser.error(f"--tail-variant: {exc}")
    t0 = time.perf_counter()
    results = []
    for m in models:
        res = study_model(m, args.steps, args.keep, config, args.seed)
        print_report(res)
        results.append(res)
    print(f"\noptimizer_study finished in {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    print(json.dumps({r["model"]: {**r["model_step"], "ratio": r["ratio"]} for r in results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
