"""The job configuration's old import path: it lives in tail_ray/jobspec.py (no Ray, no torch)."""

from tail_ray.jobspec import DATASET_NAMES, MODEL_NAMES, OPTIMIZERS, JobConfig

__all__ = ["DATASET_NAMES", "MODEL_NAMES", "OPTIMIZERS", "JobConfig"]
