"""The split plan of a checkpoint directory (or model id), from its config alone.

:func:`dry_split_plan` makes vLLM's engine config for ``model``, builds the native model
class on the ``meta`` device (nothing loaded, no weights allocated) and reads its
Attention/FFN split (:func:`afd_moe_runners.generic.split_plan_of`). Only
``config.json`` is read, so a directory holding just a released model's config (see
:class:`afd_moe_runners.recipes.DeploymentShape`) is enough with
``skip_tokenizer_init=True``. ``afd models check`` prints the result.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd_moe_runners.recipes import DeploymentShape
    from afd_moe_runners.split_plan import SplitPlan

__all__ = ["dry_split_plan", "plan_deployment_shape"]


def dry_split_plan(
    model: str,
    architecture: str,
    *,
    hf_overrides: dict[str, Any] | None = None,
    **engine_kwargs: Any,
) -> SplitPlan:
    """Plan the split of ``model`` as ``architecture`` (vLLM's native class name).

    ``engine_kwargs`` go to vLLM's ``EngineArgs`` (default ``enforce_eager=True``,
    ``max_model_len=256``). The layers' parallel groups need a world: this process's
    own if it has one (a test session), else a 1-rank one made and torn down here.
    """
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs

    from afd_moe_runners.generic import native_model_class, split_plan_of

    overrides = {**(hf_overrides or {}), "architectures": [architecture]}
    kwargs = {"enforce_eager": True, "max_model_len": 256, **engine_kwargs}
    config = EngineArgs(model=model, hf_overrides=overrides, **kwargs).create_engine_config()
    native = native_model_class(architecture)
    owned = not dist.is_initialized()
    with (
        tempfile.TemporaryDirectory(prefix="afd-dry-plan-") as tmp,
        set_current_vllm_config(config),
    ):
        if owned:
            init_distributed_environment(1, 0, f"file://{tmp}/rendezvous", 0, "gloo")
        try:
            ensure_model_parallel_initialized(1, 1)
            return split_plan_of(native, config)
        finally:
            if owned:
                cleanup_dist_env_and_memory()


def plan_deployment_shape(shape: DeploymentShape, directory: Path) -> SplitPlan:
    """The split plan of a released model's shape: its ``config.json`` is written to
    ``directory`` (no weights, no tokenizer) and planned with :func:`dry_split_plan`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.config_json(), indent=2) + "\n")
    return dry_split_plan(str(directory), shape.architecture, skip_tokenizer_init=True)
