"""``afd plan``: choose an AFD deployment's shape with a performance model.

:mod:`afd.plan.shapes` (model sizes from a ``config.json`` or a named recipe),
:mod:`afd.plan.hardware` (device presets, TOML figures), :mod:`afd.plan.model` (the
closed-form model of docs/plan.md), :mod:`afd.plan.search` (every launchable layout at
its best batch), :mod:`afd.plan.spec` (the chosen plan as an ``afd launch`` spec),
:mod:`afd.plan.calibrate` (measure a CPU host and fit its figures). Nothing here imports
torch or vLLM.
"""

from afd.plan.hardware import PRESETS, Hardware, load_hardware
from afd.plan.model import Layout, Prediction, Workload, predict
from afd.plan.search import Constraints, search
from afd.plan.shapes import ModelShape, load_shape

__all__ = [
    "PRESETS",
    "Constraints",
    "Hardware",
    "Layout",
    "ModelShape",
    "Prediction",
    "Workload",
    "load_hardware",
    "load_shape",
    "predict",
    "search",
]
