"""Planning what checkpointing a job will cost (``ckptd plan``): bytes per rank and node, staging and durable
times per tier, storage under retention, checkpoint intervals for a failure rate, and the time lost.

The arithmetic is pure (no torch, no I/O): :mod:`~ckptd.planning.model` counts parameters,
:mod:`~ckptd.planning.layout` spreads a checkpoint over a 3D-parallel layout,
:mod:`~ckptd.planning.failures` holds the failure and interval formulas and :mod:`~ckptd.planning.plan`
puts them together. :mod:`~ckptd.planning.measure` measures bandwidths on this machine for ``--measure``.
"""

from __future__ import annotations

from ckptd.planning.failures import (daly_interval_s, job_mtbf_hours, lost_fraction, per_gpu_failures_per_hour,
                                     young_interval_s)
from ckptd.planning.layout import PRESETS, Layout, StateBytes, split_checkpoint
from ckptd.planning.model import ModelShape, ParameterCount, load_config, shape_from_config
from ckptd.planning.plan import SCHEMA, Bandwidths, Plan, PlanInputs, Retention, make_plan

__all__ = ["PRESETS", "SCHEMA", "Bandwidths", "Layout", "ModelShape", "ParameterCount", "Plan", "PlanInputs",
           "Retention", "StateBytes", "daly_interval_s", "job_mtbf_hours", "load_config", "lost_fraction",
           "make_plan", "per_gpu_failures_per_hour", "shape_from_config", "split_checkpoint", "young_interval_s"]
