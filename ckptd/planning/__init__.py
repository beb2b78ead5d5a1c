"""Planning what checkpointing a job will cost (``ckptd plan``): bytes per rank and node, staging and durable
times per tier, storage under retention, checkpoint intervals for a failure rate, and the time lost.

The arithmetic is pure (no torch, no I/O): :mod:`~ckptd.planning.model` counts parameters,
:mod:`~ckptd.planning.layout` spreads a checkpoint over a 3D-parallel layout,
:mod:`~ckptd.planning.failures` holds the failure and interval formulas, :mod:`~ckptd.planning.run` a run's
length and totals over it, and :mod:`~ckptd.planning.plan` puts them together. :mod:`~ckptd.planning.measure`
measures bandwidths on this machine for ``--measure``.
"""

from __future__ import annotations

from ckptd.planning.failures import (daly_interval_s, job_mtbf_hours, lost_fraction, per_gpu_failures_per_hour,
                                     young_interval_s)
from ckptd.planning.layout import (DEFAULT_PRESET, DIRECTORY_LAYOUTS, PRESET_NOTES, PRESETS, REPLICA_MODES, Layout,
                                   StateBytes, default_replicas, split_checkpoint)
from ckptd.planning.model import ModelShape, ParameterCount, load_config, shape_from_config
from ckptd.planning.plan import SCHEMA, Bandwidths, Plan, PlanInputs, Retention, make_plan
from ckptd.planning.run import RunLength, RunTotals, run_totals

__all__ = ["DEFAULT_PRESET", "DIRECTORY_LAYOUTS", "PRESETS", "PRESET_NOTES", "REPLICA_MODES", "SCHEMA", "Bandwidths",
           "Layout", "ModelShape", "ParameterCount", "Plan", "PlanInputs", "Retention", "RunLength", "RunTotals",
           "StateBytes", "daly_interval_s", "default_replicas", "job_mtbf_hours", "load_config", "lost_fraction",
           "make_plan", "per_gpu_failures_per_hour", "run_totals", "shape_from_config", "split_checkpoint",
           "young_interval_s"]
