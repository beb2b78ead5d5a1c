"""Exporting checkpoints for use without ckptd: a Hugging Face safetensors layout for inference.

:func:`export_safetensors` turns one committed step (any world size, any tier) into
``model.safetensors`` or ``model-0000x-of-0000y.safetensors`` shards plus
``model.safetensors.index.json``, verified chunk by chunk on the way (:func:`plan_export` then
:func:`write_export`); ``ckptd export`` is its command line. :func:`save_tensors` writes in-memory
tensors to one safetensors file (``ckptd restore`` uses it).
"""

from ckptd.export.exporter import (ExportOptions, ExportPlan, ExportReport, export_safetensors, plan_export,
                                   write_export)
from ckptd.export.safetensors_file import save_tensors

__all__ = ["ExportOptions", "ExportPlan", "ExportReport", "export_safetensors", "plan_export", "save_tensors",
           "write_export"]
