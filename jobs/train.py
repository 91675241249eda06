"""Train one model with one gradient-compression method on Ray Train.

    python -m jobs.train --config jobs/configs/digits-tail.yaml [--set key=value ...] [--address ADDR]

Works three ways:
- standalone: with no --address and no RAY_ADDRESS, it connects to a Ray cluster already
  running on this machine, else starts a private local one (``--address local`` always
  starts a private one);
- as a Ray job: ``ray job submit --working-dir . -- python -m jobs.train --config ...``
  (the job supervisor sets RAY_ADDRESS; the job's submission id becomes the metrics job id);
- submitted by the tail-ray service through the Ray Jobs API (same command line).

Progress goes to stderr through logging. The last line on stdout is one JSON object: job id,
final metric, traffic per worker per step and the traffic ratio. Exit status: 0 on success,
2 on a bad config (the message says what to fix), 1 when training failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tail_ray.errors import ConfigError
from tail_ray.methods import METHODS
from tail_ray.runner.config import JobConfig

logger = logging.getLogger("jobs.train")

EXIT_TRAINING_FAILED = 1
EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    from tail_ray.runner.datasets import dataset_names
    from tail_ray.runner.models import model_names

    keys = ", ".join(JobConfig.__dataclass_fields__)
    return argparse.ArgumentParser(
        prog="python -m jobs.train",
        description=(
            "Run a data-parallel training job on Ray Train with a gradient-compression method "
            f"({', '.join(METHODS)}). Models: {', '.join(model_names())}. "
            f"Datasets: {', '.join(dataset_names())}."
        ),
        epilog=(
            f"Config keys (YAML file and --set): {keys}. "
            "Compression settings: --set compression.KEY=VALUE; for qsgd/topk/tail also "
            "compression.collective=auto|allgather|sharded|hierarchical (auto: all-gather at 2 "
            "workers, sharded from 3, hierarchical across multi-worker nodes; docs/collective.md). "
            "Examples: python -m jobs.train --config jobs/configs/smoke.yaml; "
            "python -m jobs.train --config jobs/configs/digits-tail.yaml --set steps=100 --set max_workers=1"
        ),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    p.add_argument("--config", required=True, help="YAML job config, e.g. jobs/configs/digits-tail.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (repeatable); values parse as YAML scalars",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray address (default: RAY_ADDRESS, else a running local cluster, else a new one; "
        "'local' always starts a new one)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p.parse_args(argv)


def load_config(path: str, overrides: list[str]) -> JobConfig:
    cfg = JobConfig.from_yaml(path).with_overrides(overrides)
    from tail_ray.runner.trainer import validate_job

    validate_job(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: bad job config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    # Ray 2.60 local clusters use token auth; say so explicitly (an env var set by the
    # caller, e.g. RAY_AUTH_MODE=disabled for a cluster without it, wins).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from tail_ray.runner.trainer import ensure_ray, resolve_job_id, run_job

    job_id = resolve_job_id(cfg)
    logger.info("metrics job id: %s", job_id)
    ensure_ray(args.address)
    try:
        result = run_job(cfg, job_id)
    finally:
        # Disconnect (or stop the private local Ray) first, so no late worker log line lands
        # after the summary: the summary stays the last line of the job's output.
        import ray

        ray.shutdown()
    if result.ok:
        logger.info("job %s finished in %.1f s", job_id, result.wall_s)
    else:
        logger.error("job %s failed: %s", job_id, result.error)
    print(json.dumps(result.to_dict(), default=str), flush=True)
    return 0 if result.ok else EXIT_TRAINING_FAILED


if __name__ == "__main__":
    sys.exit(main())
