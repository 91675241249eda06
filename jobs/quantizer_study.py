"""Closed-loop training with simulated workers, for quantizers not (yet) in the engine, beside Tail.

    python -m jobs.quantizer_study [--task lm] [--methods none,tail,dither-3,adam-dither-3]
                                   [--seeds 0,1,2] [--steps 300] [--warmup-steps 5] [--json PATH]

Why: ``jobs.optimizer_study`` weighs a quantizer open loop, by how much of the optimizer's true
step it delivers. This one trains with it, so the final validation metric says whether that
step was worth its bytes. Two workers are simulated in one process (no process group): each
computes its gradient on its own batch of bench_convergence's task (the same model, data,
optimizer and lr schedule), every worker's gradient is quantized, and the optimizer steps on
the mean of what they decode.

Methods (B: bits, 2..8, or "auto"):
  none             the true mean
  tail             the engine: one TailCompressor per worker, the payloads exchanged as the
                   all-gather hook does (bench_codec.run_step); bytes are the payloads' lengths
  nearest-B        B bits for every matrix, nearest rounding with error feedback: today's
                   quantizer without the controller, low-rank or float16 small layers
  dither-B         B bits, subtractive dither: level = floor(x / step + u), decoded as
                   (level - u + 1/2) * step, with u ~ U[0, 1) that the receivers draw too (from
                   the sender's seed): the error is uniform on +-step/2 whatever x, and unbiased
                   without error feedback, so there is none
  dither-ef-B      dither-B with error feedback: x = g + the residual left last step, and
                   x - decoded kept for the next one (the delivered noise is the difference of
                   two roundings', which momentum averages away)
  adam-dither-B    dither-B on g / s, with s = sqrt of the bias-corrected EMA (beta 0.999) of the
                   decoded mean's square: Adam's own scale, the same on every rank, no traffic
  anti-dither-B    dither-B with the ranks in pairs: the odd rank dithers with 1 - u of its even
                   partner's u (antithetic, as in correlated quantization for distributed mean
                   estimation): for values far below a step the pair's errors cancel in the
                   mean; each rank's own error is still one dither (no extra traffic)
  tdither-B        dither-B antithetic in time: each rank's odd step dithers with 1 - u of its
                   own step before, so momentum averages a pair of nearly opposite errors
                   while Adam's v still sees one rounding per step (error feedback's delivered
                   noise is highpass too, at twice the variance)
  dither-auto,     the same quantizers with Tail's budget picking the bits per layer and step:
  adam-dither-auto the smallest of TailConfig's candidate bits whose dither noise (step^2 / 12
                   per element, known exactly: no sampling) is within tau of the layer's
                   power, tau from the engine's own BudgetPolicy (noise fraction of the
                   between-worker spread, critical phases after warm-up and lr drops). For
                   adam-dither everything is measured in the quantized geometry g / s. One
                   decision per layer for both workers, from rank 0's gradient.

The prototypes quantize matrices (>= 1024 elements) in max-abs buckets of 512; smaller layers
go exactly and are counted as float16; the first --warmup-steps steps go exactly and are
counted as fp32 (or, with --warmup-bits B, at B bits with the method's own quantizer). Their
bytes are the levels' order-0 entropy plus 4 B per bucket scale: the bound a coder reaches,
not a payload (Tail's own levels code within 2 % of it, docs/engine.md).
Per seed and method it prints the final metric, its difference from none, and the traffic
reduction over the whole run and over its second half; then the mean and worst per method.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from jobs.bench_codec import run_step
from jobs.bench_convergence import TASKS, Task, make_optimizer
from jobs.output_path import output_file
from tail_ray.bitwidth.policy import BudgetPolicy
from tail_ray.collective.state import linear_in_gradient
from tail_ray.compression.base import Compressor
from tail_ray.compression.entropy import entropy_bound_bytes
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.errors import ConfigError
from tail_ray.settings import settings_from_mapping

log = logging.getLogger("quantizer_study")

WORLD = 2  # simulated workers, as in the other offline studies
BUCKET = 512  # Tail's default bucket
MATRIX_NUMEL = 1024  # Tail's raw_below_numel: smaller layers are not quantized
EMA_BETA = 0.999  # Adam's beta2: the adam-dither scale's memory
EPS = 1e-8  # Adam's eps
PROTOTYPES = ("nearest", "dither", "dither-ef", "adam-dither", "anti-dither", "tdither")

FEEDBACK = ("nearest", "dither-ef")  # prototypes that keep a residual and resend it
ANTITHETIC = ("anti-dither", "tdither")  # dither paired with 1 - u: across ranks, across steps
Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Warmup:
    """The prototypes' first ``steps`` steps: matrices exact as fp32 (``bits`` 32), or at
    ``bits`` with the method's own quantizer (the budget then does not pick)."""

    steps: int = 5
    bits: int = 32

    @property
    def exact(self) -> bool:
        return self.bits >= 32


@dataclass(frozen=True)
class Method:
    """A ``--methods`` entry: ``kind`` none, tail or a prototype, ``bits`` for a prototype."""

    kind: str
    bits: int = 0  # 0: none, tail, or a prototype whose bits the budget picks (``auto``)

    @classmethod
    def parse(cls, text: str) -> Method:
        """``text`` as a Method; a ValueError says what is accepted."""
        if text in ("none", "tail"):
            return cls(text)
        kind, _, bits = text.rpartition("-")
        if kind in PROTOTYPES and bits == "auto":
            return cls(kind)
        if kind in PROTOTYPES and bits.isdigit() and 2 <= int(bits) <= 8:
            return cls(kind, int(bits))
        raise ValueError(
            f"unknown method {text!r}: none, tail, or {'/'.join(PROTOTYPES)}-B with B in 2..8 or auto"
        )

    @property
    def auto(self) -> bool:
        return self.kind in PROTOTYPES and not self.bits

    @property
    def label(self) -> str:
        if self.kind not in PROTOTYPES:
            return self.kind
        return f"{self.kind}-{self.bits or 'auto'}"


def _grid(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (flat) as rows of BUCKET (zero-padded), and each row's grid step: max-abs / L, 0 for
    an all-zero row (a zero scale on the wire: the row decodes to exactly 0, with no dither)."""
    rows = torch.nn.functional.pad(x, (0, (-x.numel()) % BUCKET)).view(-1, BUCKET)
    return rows, rows.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)


def _in_steps(rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """rows / step, with an all-zero row (step 0) left at 0."""
    return rows / torch.where(step > 0, step, torch.ones_like(step))


def quantize_nearest(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded, levels) of x on the max-abs grid, rounded to the nearest level."""
    rows, step = _grid(x, bits)
    t = _in_steps(rows, step)
    levels = torch.sign(t) * torch.floor(t.abs() + 0.5)
    return (levels * step).flatten()[: x.numel()], levels.flatten()[: x.numel()]


def quantize_dither(
    x: torch.Tensor, bits: int, gen: torch.Generator, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded, levels) of x with subtractive dither (module doc); levels stay in [-L, L].
    An all-zero row (a row of the embedding's unseen tokens) decodes to 0: dithering it would
    hand Adam noise, and so full-size steps, for parameters that had no gradient.
    ``u``: the dither, one per element of x's rows of BUCKET (default: drawn from ``gen``)."""
    rows, step = _grid(x, bits)
    if u is None:
        u = torch.rand(rows.shape, generator=gen)  # the receivers draw the same from the sender's seed
    levels = torch.floor(_in_steps(rows, step) + u)
    return ((levels - u + 0.5) * step).flatten()[: x.numel()], levels.flatten()[: x.numel()]


def level_bytes(levels: torch.Tensor) -> float:
    """What a coder needs for these levels at best: their order-0 entropy, plus fp32 scales."""
    return entropy_bound_bytes(levels.to(torch.int8).numpy()) + 4.0 * math.ceil(levels.numel() / BUCKET)


def true_mean(per_rank: list[Grads]) -> Grads:
    return {n: torch.stack([r[n] for r in per_rank]).mean(0) for n in per_rank[0]}


def dither_noise_sq(x: torch.Tensor, bits: int) -> float:
    """The summed variance dither adds to x at ``bits``: step^2 / 12 for each real element."""
    rows, step = _grid(x, bits)
    counts = torch.full((rows.shape[0],), float(BUCKET))
    counts[-1] = x.numel() - BUCKET * (rows.shape[0] - 1)  # the last row's padding is not sent
    return float((counts * step.flatten().square()).sum()) / 12.0


class PrototypeExchange:
    """One prototype's exchange over a run: the residuals (nearest), the shared scale
    (adam-dither), and for ``auto`` the engine's budget and the bits it picked."""

    def __init__(
        self,
        method: Method,
        seed: int,
        warmup: Warmup,
        linear: bool = False,
        config: TailConfig | None = None,
    ) -> None:
        self.method = method
        self.warmup = warmup
        self.gens = [torch.Generator().manual_seed(1000 * seed + rank) for rank in range(WORLD)]
        self.residuals: list[Grads] = [{} for _ in range(WORLD)]
        self.ema: Grads = {}  # EMA of the decoded mean's square (adam-dither)
        self.first_u: dict[tuple[int, str], torch.Tensor] = {}  # anti-dither, tdither: u to pair with
        self.updates = 0
        config = config or TailConfig()  # the -auto budget's settings (--budget)
        self.candidates = sorted(config.candidate_bits)
        self.policy = BudgetPolicy(config.budget_settings())
        self.policy.set_linear(linear)
        self.bits_numel: list[Counter[int]] = []  # per step: quantized elements at each width

    def deliver(self, per_rank: list[Grads], step: int, lr: float) -> tuple[Grads, float]:
        """The mean every rank decodes, and the bytes one worker sent for it."""
        self.policy.set_lr(lr, step)
        self.bits_numel.append(Counter())
        mean, sent = {}, 0.0
        warming = step < self.warmup.steps
        for name, g0 in per_rank[0].items():
            if (warming and self.warmup.exact) or g0.numel() < MATRIX_NUMEL:
                mean[name] = torch.stack([r[name] for r in per_rank]).mean(0)
                sent += (4 if warming else 2) * g0.numel()
                continue
            mean[name], nbytes = self._layer(name, [r[name].flatten() for r in per_rank], step, warming)
            mean[name] = mean[name].view_as(g0)
            sent += nbytes
        self._observe(mean)
        return mean, sent

    def _layer(
        self, name: str, grads: list[torch.Tensor], step: int, warming: bool
    ) -> tuple[torch.Tensor, float]:
        scale = None
        if self.method.kind == "adam-dither" and name in self.ema:
            scale = (self.ema[name] / (1 - EMA_BETA**self.updates)).sqrt() + EPS
        if self.method.kind in FEEDBACK:
            xs = [g + self.residuals[rank].get(name, torch.zeros_like(g)) for rank, g in enumerate(grads)]
        else:
            xs = [g if scale is None else g / scale for g in grads]
        if warming:
            bits = self.warmup.bits
        else:
            bits = self._bits(name, xs[0], step) if self.method.auto else self.method.bits
        self.bits_numel[-1][bits] += xs[0].numel()
        decoded_xs, sent = [], 0.0
        for rank, x in enumerate(xs):
            if self.method.kind == "nearest":
                decoded, levels = quantize_nearest(x, bits)
                self.residuals[rank][name] = x - decoded  # error feedback: resent next step
            elif self.method.kind in ANTITHETIC:
                u = self._antithetic_u(rank, name, step, x)
                decoded, levels = quantize_dither(x, bits, self.gens[rank], u)
            else:
                decoded, levels = quantize_dither(x, bits, self.gens[rank])
                if self.method.kind == "dither-ef":
                    self.residuals[rank][name] = x - decoded
            decoded_xs.append(decoded)
            sent += level_bytes(levels) / WORLD  # one worker's share: each sends its own
        if self.method.auto:
            self._observe_spread(name, grads, xs, decoded_xs, bits)
        total = torch.zeros_like(grads[0])
        for decoded in decoded_xs:
            total += decoded if scale is None else decoded * scale
        return total / WORLD, sent

    def _antithetic_u(self, rank: int, name: str, step: int, x: torch.Tensor) -> torch.Tensor:
        """The dither of anti-dither and tdither: a fresh u, or 1 - u of the draw it is paired with
        (anti-dither: the even rank's of this step; tdither: this rank's own of the step before)."""
        key = (rank - rank % 2, name) if self.method.kind == "anti-dither" else (rank, name)
        pairs_second = rank % 2 == 1 if self.method.kind == "anti-dither" else step % 2 == 1
        if pairs_second and key in self.first_u:
            return 1.0 - self.first_u.pop(key)
        u = torch.rand((math.ceil(x.numel() / BUCKET), BUCKET), generator=self.gens[rank])
        self.first_u[key] = u
        return u

    def _noise_sq(self, x: torch.Tensor, bits: int) -> float:
        """What quantizing x at ``bits`` adds, summed: exact for nearest, dither's known variance."""
        if self.method.kind == "nearest":
            return float((quantize_nearest(x, bits)[0] - x).square().sum())
        return dither_noise_sq(x, bits)

    def _bits(self, name: str, x: torch.Tensor, step: int) -> int:
        """The engine's rule (bitwidth/plan.py: pick_bits): the smallest candidate whose relative
        error is within tau, else the largest: accuracy first."""
        self.policy.observe_norm(name, float(x.norm()), step)
        tau = self.policy.tau(name, step)
        power = float(x.square().sum())
        for bits in self.candidates:
            if power <= 0 or self._noise_sq(x, bits) <= tau * power:
                return bits
        return self.candidates[-1]

    def _observe_spread(
        self,
        name: str,
        grads: list[torch.Tensor],
        xs: list[torch.Tensor],
        decoded: list[torch.Tensor],
        bits: int,
    ) -> None:
        """The between-worker spread of the decoded layer (in the quantized geometry), per
        element, less what compression put there: dither's known variance; for nearest, its
        rounding error and the residual carried in (decoded - gradient). As the engine's
        all-gather feeds its BudgetPolicy (TailCompressor.observe_peers)."""
        stack, n = torch.stack(decoded), float(xs[0].numel())
        spread = float((stack - stack.mean(0)).square().sum()) / (WORLD - 1) / n
        if self.method.kind in FEEDBACK:
            errors = [float((d - g).square().sum()) for d, g in zip(decoded, grads, strict=True)]
        else:
            errors = [dither_noise_sq(x, bits) for x in xs]
        compression = statistics.mean(errors) / n
        grad_sq = float(stack.square().sum(1).mean()) / n - compression
        self.policy.observe_spread(name, spread, compression, grad_sq)

    def bits_share(self, first_step: int) -> dict[int, float]:
        """Share of quantized elements at each width over steps >= first_step."""
        total: Counter[int] = Counter()
        for counts in self.bits_numel[first_step:]:
            total.update(counts)
        n = sum(total.values())
        return {b: c / n for b, c in sorted(total.items())} if n else {}

    def _observe(self, mean: Grads) -> None:
        self.updates += 1
        for name, m in mean.items():
            square = m.flatten().square()
            self.ema[name] = EMA_BETA * self.ema.get(name, torch.zeros_like(square)) + (1 - EMA_BETA) * square


class TailExchange:
    """The engine: one TailCompressor per simulated worker, as the all-gather hook runs them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.comps: list[Compressor] = [TailCompressor() for _ in range(WORLD)]
        for comp in self.comps:  # the budget a trainer on this optimizer gets (bitwidth/policy.py)
            comp.set_linear_optimizer(linear_in_gradient(optimizer))

    def deliver(self, per_rank: list[Grads], lr: float) -> tuple[Grads, float]:
        sizes: list[int] = []
        mean = run_step(self.comps, per_rank, lr, sizes)
        return mean, float(np.mean(sizes))


@dataclass
class Row:
    task: str
    method: str
    seed: int
    metric: str
    final: float
    vs_none: float | None  # % of none's loss, or accuracy points against none
    ratio: float  # fp32 bytes over bytes sent per worker, whole run
    ratio_2nd_half: float
    wall_s: float
    # A prototype's share of quantized elements at each bit-width in the second half ({} else)
    bits_2nd_half: dict[int, float] = field(default_factory=dict)


def _gradients(model: torch.nn.Module, data: Any, task: Task, step: int, rank: int) -> Grads:
    batch = data.batch(step, rank, WORLD, task.batch_size)
    model.zero_grad(set_to_none=True)
    data.loss(model, *(batch if isinstance(batch, tuple) else (batch,))).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train(
    task_name: str, method: Method, seed: int, steps: int, warmup: Warmup, budget: TailConfig | None = None
) -> Row:
    """One closed-loop run; ``vs_none`` is left for ``study`` to fill in."""
    started = time.perf_counter()
    task = TASKS[task_name]
    model, data = task.build(seed)
    opt = make_optimizer(task, model.parameters())
    tail = TailExchange(opt) if method.kind == "tail" else None
    proto = None
    if method.kind in PROTOTYPES:
        linear = linear_in_gradient(opt)
        proto = PrototypeExchange(method, seed, warmup, linear=linear, config=budget)
    drop_step = int(task.lr_drop_at * steps)
    sent, raw = [], 0
    for step in range(steps):
        lr = task.lr * (0.1 if step >= drop_step else 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        per_rank = [_gradients(model, data, task, step, rank) for rank in range(WORLD)]
        raw = 4 * sum(g.numel() for g in per_rank[0].values())
        if tail is not None:
            mean, nbytes = tail.deliver(per_rank, lr)
        elif proto is not None:
            mean, nbytes = proto.deliver(per_rank, step, lr)
        else:
            mean, nbytes = true_mean(per_rank), float(raw)
        for name, p in model.named_parameters():
            p.grad = mean.get(name)
        opt.step()
        sent.append(nbytes)
    final = float(data.evaluate(model)[task.metric])
    return Row(
        task=task_name,
        method=method.label,
        seed=seed,
        metric=task.metric,
        final=final,
        vs_none=None,
        ratio=raw / float(np.mean(sent)),
        ratio_2nd_half=raw / float(np.mean(sent[steps // 2 :])),
        wall_s=time.perf_counter() - started,
        bits_2nd_half={} if proto is None else proto.bits_share(steps // 2),
    )


def _vs_none(row: Row, none: Row | None) -> float | None:
    if none is None:
        return None
    if row.metric == "val_loss":
        return 100.0 * (row.final / none.final - 1.0)
    return 100.0 * (row.final - none.final)


def study(
    task: str,
    methods: list[Method],
    seeds: list[int],
    steps: int,
    warmup: Warmup,
    budget: TailConfig | None = None,
) -> list[Row]:
    """Every method on every seed (none first when asked for, so the others compare to it)."""
    rows = []
    for seed in seeds:
        none = None
        for method in sorted(methods, key=lambda m: m.kind != "none"):
            log.info("seed %d: %s, %d steps", seed, method.label, steps)
            row = train(task, method, seed, steps, warmup, budget)
            none = row if method.kind == "none" else none
            row.vs_none = _vs_none(row, none)
            rows.append(row)
            print(_format(row), flush=True)
    return rows


def _format(row: Row) -> str:
    unit = "%" if row.metric == "val_loss" else "pt"
    vs = "" if row.vs_none is None else f"{row.vs_none:+8.2f}{unit}"
    bits = " ".join(f"{b}b {share:.0%}" for b, share in row.bits_2nd_half.items())
    return (
        f"seed {row.seed:<3d} {row.method:<16s} {row.metric} {row.final:8.4f} {vs:>10s} "
        f"{row.ratio:7.2f}x {row.ratio_2nd_half:7.2f}x (2nd half) {row.wall_s:6.1f} s"
        + (f"  bits (2nd half): {bits}" if bits else "")
    )


def summary(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Per method: mean and worst difference from none, mean traffic reduction."""
    out: dict[str, dict[str, float | None]] = {}
    for label in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == label]
        vs = [r.vs_none for r in mine if r.vs_none is not None]
        worst = max if mine[0].metric == "val_loss" else min  # a higher loss, a lower accuracy
        out[label] = {
            "mean_vs_none": statistics.mean(vs) if vs else None,
            "worst_vs_none": worst(vs) if vs else None,
            "ratio": statistics.mean(r.ratio for r in mine),
            "ratio_2nd_half": statistics.mean(r.ratio_2nd_half for r in mine),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.quantizer_study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="lm", help="bench_convergence's task")
    parser.add_argument("--methods", default="none,tail,dither-3,adam-dither-3", help="comma list")
    parser.add_argument("--seeds", default="0", help="comma list of data / model seeds")
    parser.add_argument("--steps", type=int, help="default: the task's own (300 for lm and digits)")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="steps before the prototypes' own bits (default 5)"
    )
    parser.add_argument(
        "--warmup-bits",
        type=int,
        choices=(*range(2, 9), 32),
        default=32,
        help="the prototypes' matrices in those steps: 32 = exact fp32 (default), 2..8 = that many "
        "bits with the method's quantizer (Adam's v keeps the first steps' noise for the whole run)",
    )
    parser.add_argument(
        "--budget",
        metavar="JSON",
        default="{}",
        help="TailConfig settings for the -auto prototypes' budget, e.g. '{\"noise_fraction\": 0.5}' "
        "(tail rows keep the engine's defaults)",
    )
    parser.add_argument("--json", type=output_file, help="also write the rows and the summary here")
    args = parser.parse_args(argv)
    try:
        methods = [Method.parse(m) for m in args.methods.split(",") if m]
        seeds = [int(s) for s in args.seeds.split(",") if s]
        budget_settings = json.loads(args.budget)
        if not isinstance(budget_settings, dict):
            raise ValueError("--budget must be a JSON object of TailConfig settings")
        budget = settings_from_mapping(TailConfig, budget_settings, what="--budget")
    except (ValueError, ConfigError) as exc:  # json's errors are ValueErrors
        parser.error(str(exc))
    steps = args.steps if args.steps is not None else TASKS[args.task].steps
    if steps < 1 or args.warmup_steps < 0 or not methods or not seeds:
        parser.error("--steps must be >= 1, --warmup-steps >= 0, and --methods and --seeds not empty")
    warmup = Warmup(args.warmup_steps, args.warmup_bits)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # One thread: matmul's reduction order, and so the whole trajectory, then does not depend
    # on how many cores the machine has (two threads and one differ by ~0.5 % of loss at 300 steps).
    torch.set_num_threads(1)
    rows = study(args.task, methods, seeds, steps, warmup, budget)
    result = summary(rows)
    print(f"\n== {args.task}, {len(seeds)} seed(s), {steps} steps, {WORLD} simulated workers")
    if budget_settings:
        print(f"-auto prototypes' budget: TailConfig with {budget_settings}")
    for label, s in result.items():
        mean, worst = s["mean_vs_none"], s["worst_vs_none"]
        vs = "" if mean is None or worst is None else f"vs none mean {mean:+.2f}, worst {worst:+.2f}"
        print(f"{label:<16s} {vs:<34s} {s['ratio']:6.2f}x ({s['ratio_2nd_half']:.2f}x 2nd half)")
    if args.json:
        doc = {"rows": [asdict(r) for r in rows], "summary": result, "budget": budget_settings}
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
