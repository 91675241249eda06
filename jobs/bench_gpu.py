"""GPU codec benchmark (issue 12): compress / decompress GB/s side by side in one run, and DDP steps.

On a CUDA machine, over a transformer-shaped gradient set (12 blocks of d=1024: 151M fp32
parameters, 604 MB; ``--quick``: 2 blocks of d=512), prints and optionally writes as JSON:

  codec rows    GB/s of fp32 gradient, compress and decompress-to-GPU, and the payload ratio:
                device copy (the yardstick), fp16 cast, plain torch 4-bit bucket quantize +
                nibble pack (no custom kernel), the Triton kernels alone (error feedback +
                scales + dithered, nearest or stochastic levels + packing, on the device), one
                low-rank step of block 0's matrices on the device vs the host, and the project's
                compressors end to end (qsgd-4, tail) on the Triton backend vs the CPU backend
                (what CUDA gradients went through before: copy to host, numba, one thread)
  ddp rows      ms per training step of a 5.3M-parameter MLP under DDP at world size 1
                (nccl) with the none / fp16 / qsgd / tail hooks, qsgd and tail on both backends
                (link-aware switch off: every step compressed)

Every figure comes from this one run on this one machine; the "x copy" column is each row's
compress GB/s as a share of the same-run device copy.

  python -m jobs.bench_gpu --json out/bench_gpu.json   # CUDA machine: ~2-4 min on an H200
  python -m jobs.bench_gpu --quick                     # smaller gradient set
  python -m jobs.bench_gpu --interpret --quick         # no GPU: Triton's CPU interpreter on CPU
                                                       # tensors; checks the script, the
                                                       # figures mean NOTHING

Without CUDA (and without ``--interpret``) it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from jobs.output_path import output_file

log = logging.getLogger("bench_gpu")

BACKEND_ENV = "TAIL_RAY_CODEC_BACKEND"  # tail_ray.compression.device.BACKEND_ENV (imported late)


@dataclass
class CodecRow:
    what: str
    compress_gbs: float | None
    decompress_gbs: float | None
    ratio: float | None
    note: str = ""


@dataclass
class DdpRow:
    method: str
    backend: str
    step_ms: float
    steps: int


@dataclass(frozen=True)
class Shape:
    d: int
    blocks: int

    def layers(self) -> list[tuple[str, tuple[int, ...]]]:
        d = self.d
        out: list[tuple[str, tuple[int, ...]]] = []
        for b in range(self.blocks):
            p = f"blocks.{b}."
            out += [
                (p + "ln1.weight", (d,)),
                (p + "ln1.bias", (d,)),
                (p + "attn.qkv.weight", (3 * d, d)),
                (p + "attn.qkv.bias", (3 * d,)),
                (p + "attn.proj.weight", (d, d)),
                (p + "attn.proj.bias", (d,)),
                (p + "ln2.weight", (d,)),
                (p + "ln2.bias", (d,)),
                (p + "mlp.fc1.weight", (4 * d, d)),
                (p + "mlp.fc1.bias", (4 * d,)),
                (p + "mlp.fc2.weight", (d, 4 * d)),
                (p + "mlp.fc2.bias", (d,)),
            ]
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one untimed warm-up call."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@contextmanager
def backend(name: str) -> Iterator[None]:
    old = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = old


def make_grads(shape: Shape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    grads = {}
    for name, dims in shape.layers():
        scale = 1e-3 * (1 + zlib.crc32(name.encode()) % 7)  # layers differ in scale
        grads[name] = (torch.randn(dims, generator=gen) * scale).to(device)
    return grads


# --------------------------------------------------------------------------- plain torch


def torch_quantize4(flat: torch.Tensor, bucket: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit bucket max-abs stochastic quantization + nibble packing in plain torch ops."""
    n = flat.numel()
    pad = (-n) % bucket
    x = torch.nn.functional.pad(flat, (0, pad)).view(-1, bucket)
    s = x.abs().amax(dim=1, keepdim=True)
    y = x / s.clamp_min(1e-30) * 7.0
    q = torch.floor(y.abs() + torch.rand_like(y)).clamp_max_(7.0) * torch.sign(y)
    sym = (q + 7.0).to(torch.uint8).view(-1)
    return sym[0::2] | (sym[1::2] << 4), s.view(-1)


def torch_dequantize4(packed: torch.Tensor, scales: torch.Tensor, n: int, bucket: int = 512) -> torch.Tensor:
    sym = torch.stack([packed & 15, packed >> 4], dim=1).view(-1, bucket).to(torch.float32)
    return ((sym - 7.0) * (scales.view(-1, 1) / 7.0)).view(-1)[:n]


# --------------------------------------------------------------------------- rows


def codec_rows(
    grads: dict[str, torch.Tensor], device: torch.device, repeats: int, slow_repeats: int
) -> list[CodecRow]:
    from tail_ray.compression import device_codec
    from tail_ray.compression.device import DeviceFlat
    from tail_ray.compression.qsgd import QSGDCompressor, QSGDConfig
    from tail_ray.compression.tail import TailCompressor, TailConfig

    numel = sum(g.numel() for g in grads.values())
    gb = 4 * numel / 1e9
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    rows: list[CodecRow] = []

    def row(what: str, c_s: float | None, d_s: float | None, ratio: float | None, note: str = "") -> None:
        r = CodecRow(what, gb / c_s if c_s else None, gb / d_s if d_s else None, ratio, note)
        rows.append(r)
        log.info("%s: %s", what, r)

    dst = torch.empty_like(flat)
    row("device copy", best_s(lambda: dst.copy_(flat), device, repeats), None, 1.0, "the yardstick")
    half = flat.half()
    row(
        "fp16 cast",
        best_s(lambda: flat.half(), device, repeats),
        best_s(lambda: half.float(), device, repeats),
        2.0,
    )
    packed, scales = torch_quantize4(flat)
    row(
        "torch 4-bit quantize + nibble pack",
        best_s(lambda: torch_quantize4(flat), device, repeats),
        best_s(lambda: torch_dequantize4(packed, scales, numel), device, repeats),
        4 * numel / (packed.numel() + 4 * scales.numel()),
        "plain torch ops, no error feedback",
    )

    # The Triton kernels alone, per layer as the compressor runs them (raw layers skipped).
    big = {k: DeviceFlat(g.reshape(-1).contiguous()) for k, g in grads.items() if g.numel() >= 4096}
    resid = {k: torch.zeros(g.size, device=device) for k, g in big.items()}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    big_gb = 4 * sum(g.size for g in big.values()) / 1e9

    def kernels_decompress() -> None:
        for k, (p, s) in out.items():
            device_codec.dequantize(p, s, 4, 512, big[k].size)

    # Every rounding side by side: dither (Tail's default) reads the uniform table and keeps no
    # residual, nearest draws no uniforms, stochastic hashes one per element.
    for rounding in ("dither", "nearest", "stochastic"):

        def kernels_compress(rounding: str = rounding) -> None:
            for k, g in big.items():
                e = None if rounding == "dither" else resid[k]
                p, s, _, _ = device_codec.quantize_device(g, e, 4, 512, 7, rounding)
                out[k] = (p, s)

        c_s = best_s(kernels_compress, device, repeats)
        sent = sum(p.numel() + 4 * s.numel() for p, s in out.values())
        rows.append(
            CodecRow(
                f"triton kernels 4-bit, {rounding}",
                big_gb / c_s,
                big_gb / best_s(kernels_decompress, device, repeats),
                4 * sum(g.size for g in big.values()) / sent,
                ("scales + levels + pack" if rounding == "dither" else "EF + scales + levels + pack")
                + " on the device only: no entropy coding",
            )
        )

    rows += lowrank_rows(grads, device, slow_repeats)
    compressors: list[tuple[str, Callable[[], Any]]] = [
        ("qsgd-4", lambda: QSGDCompressor(QSGDConfig(bits=4, seed=1))),
        ("tail", lambda: TailCompressor(TailConfig(seed=1))),
    ]
    for name, make in compressors:
        for be in ("triton", "cpu"):
            with backend(be):
                comp = make()
                payload = comp.compress(grads)  # warm-up (and the controller's first decisions)
                c_s = best_s(lambda comp=comp: comp.compress(grads), device, slow_repeats)
                payload = comp.compress(grads)
                into = {k: torch.empty_like(g) for k, g in grads.items()}
                d_s = best_s(lambda c=comp, p=payload, o=into: c.aggregate([p], o), device, slow_repeats)
            what = f"tail_ray {name}, {be} backend"
            note = "today's path: to host, numba, 1 thread" if be == "cpu" else "kernels + CPU entropy coder"
            row(what, c_s, d_s, 4 * numel / len(payload), note)
    return rows


def lowrank_rows(grads: dict[str, torch.Tensor], device: torch.device, repeats: int) -> list[CodecRow]:
    """One low-rank step (power step, factors quantized, reconstruction, residual) of the first
    block's four matrices at rank 8, on the device (lowrank_device.py) and on the host (the CPU
    path's fixed-order numba products, one thread), side by side."""
    import numpy as np

    from tail_ray.compression.grid import SCALE_BYTES
    from tail_ray.compression.lowrank import compress_lowrank
    from tail_ray.compression.lowrank_device import compress_lowrank_device

    mats = {k: g for k, g in grads.items() if k.startswith("blocks.0.") and g.dim() == 2}
    gb = 4 * sum(g.numel() for g in mats.values()) / 1e9
    gen = torch.Generator().manual_seed(3)
    warm = {k: torch.randn(g.shape[1], 8, generator=gen) for k, g in mats.items()}
    host = {k: g.reshape(-1).cpu().numpy() for k, g in mats.items()}
    sent: dict[str, int] = {}

    def on_device() -> None:
        for k, g in mats.items():
            m = g.reshape(-1)
            rec, _, recon = compress_lowrank_device(k, m, *g.shape, warm[k], bits=8, bucket_size=512, seed=1)
            torch.sub(m, recon)
            n_scales = rec.p_scales.size + rec.q_scales.size
            sent[k] = rec.p_levels.size + rec.q_levels.size + SCALE_BYTES * n_scales

    def on_host() -> None:
        for k, g in mats.items():
            _, _, recon = compress_lowrank(k, host[k], *g.shape, warm[k], bits=8, bucket_size=512, seed=1)
            np.subtract(host[k], recon)

    d_s, h_s = best_s(on_device, device, repeats), best_s(on_host, device, max(1, repeats // 2))
    ratio = 4 * sum(g.numel() for g in mats.values()) / sum(sent.values())
    note = "power step + factors + reconstruction + residual, block 0's matrices"
    return [
        CodecRow("low-rank r8 step, device", gb / d_s, None, ratio, note + " (lowrank_device)"),
        CodecRow("low-rank r8 step, host", gb / h_s, None, ratio, note + " (numba, 1 thread)"),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_step(method: str, device: torch.device, d: int, ddp_cls: Any, register: Any) -> Callable[[], None]:
    """One training step of a fresh 5.3M-parameter MLP (d=1024) under DDP with ``method``'s hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d, 2 * d), torch.nn.ReLU(), torch.nn.Linear(2 * d, d), torch.nn.ReLU(),
        torch.nn.Linear(d, d),
    ).to(device)  # fmt: skip
    ddp = ddp_cls(model, device_ids=[device.index] if device.type == "cuda" else None)
    register(ddp, method, {"link_aware": False} if method in ("qsgd", "tail") else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(64, d, device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()

    return step


def ddp_rows(device: torch.device, d: int, steps: int) -> list[DdpRow]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tail_ray.collective import register_tail_hook

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
    rows = []
    try:
        for method, be in [
            ("none", "-"),
            ("fp16", "-"),
            ("qsgd", "triton"),
            ("qsgd", "cpu"),
            ("tail", "triton"),
            ("tail", "cpu"),
        ]:
            step = _ddp_step(method, device, d, DDP, register_tail_hook)
            with backend(be if be != "-" else "auto"):
                for _ in range(3):
                    step()
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                _sync(device)
            r = DdpRow(method, be, 1000 * (time.perf_counter() - t0) / steps, steps)
            log.info("ddp: %s", r)
            rows.append(r)
    finally:
        dist.destroy_process_group()
    return rows


def machine(device: torch.device, interpret: bool) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "interpret": interpret,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def print_tables(meta: dict[str, Any], rows: list[CodecRow], ddp: list[DdpRow]) -> None:
    copy = next((r.compress_gbs for r in rows if r.what == "device copy"), None)
    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  driver {meta.get('driver')}")
    print(f"{meta['numel'] / 1e6:.1f}M fp32 gradient elements in {meta['layers']} layers\n")
    print(f"{'what':52s} {'compress GB/s':>14s} {'x copy':>7s} {'decompress':>11s} {'ratio':>6s}  notes")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        share = r.compress_gbs / copy if (r.compress_gbs and copy) else None
        print(
            f"{r.what:52s} {f(r.compress_gbs, '14.3f')} {f(share, '7.3f')} "
            f"{f(r.decompress_gbs, '11.3f')} {f(r.ratio, '6.2f')}  {r.note}"
        )
    if ddp:
        print(f"\n{'DDP step (world size 1)':30s} {'backend':8s} {'ms/step':>8s}")
        for d in ddp:
            print(f"{d.method:30s} {d.backend:8s} {d.step_ms:8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=output_file, help="also write the figures here")
    ap.add_argument("--quick", action="store_true", help="2 blocks of d=512 (12.6M) instead of 12 of d=1024")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per device-only row (min taken)")
    ap.add_argument("--slow-repeats", type=int, default=3, help="timed calls per compressor row")
    ap.add_argument("--ddp-steps", type=int, default=20, help="timed DDP steps per method (0: skip)")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="no GPU: run the Triton kernels in Triton's CPU interpreter on tiny CPU tensors "
        "(checks the script; the figures mean nothing)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_gpu: triton is not installed: pip install 'tail-ray[gpu]'", file=sys.stderr)
        return 2
    if not args.interpret and not torch.cuda.is_available():
        print(
            f"bench_gpu: no CUDA device (torch {torch.__version__} sees none): nothing to measure.\n"
            "  Run it on a CUDA machine (jobs/gpu_check.sh runs it with the GPU tests), or pass\n"
            "  --interpret to exercise the script through Triton's CPU interpreter (figures meaningless).",
            file=sys.stderr,
        )
        return 2
    if args.interpret:
        print("bench_gpu: WARNING: --interpret runs Triton's CPU interpreter: every figure below is "
              "MEANINGLESS (it only shows the script runs)", file=sys.stderr)  # fmt: skip
        device, shape, repeats, slow, ddp_d = torch.device("cpu"), Shape(64, 1), 1, 1, 64
        steps = min(args.ddp_steps, 2)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        shape = Shape(512, 2) if args.quick else Shape(1024, 12)
        repeats, slow, ddp_d, steps = args.repeats, args.slow_repeats, 1024, args.ddp_steps

    from tail_ray.warmup import warmup

    t0 = time.perf_counter()
    warmup(max_world=1)
    warm_s = time.perf_counter() - t0
    grads = make_grads(shape, device)
    meta = machine(device, args.interpret)
    meta.update(
        numel=sum(g.numel() for g in grads.values()),
        layers=len(grads),
        numba_warmup_s=round(warm_s, 2),
        shape=asdict(shape),
    )
    rows = codec_rows(grads, device, repeats, slow)
    ddp = ddp_rows(device, ddp_d, steps) if steps > 0 else []
    print_tables(meta, rows, ddp)
    if args.json:
        doc = {"meta": meta, "codec": [asdict(r) for r in rows], "ddp": [asdict(r) for r in ddp]}
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
