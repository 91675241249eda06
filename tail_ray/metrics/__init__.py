"""Metric records and the sink workers push them to."""

from tail_ray.metrics.records import LayerMetric, StepMetric

__all__ = ["LayerMetric", "StepMetric"]
