"""Test support: real vLLM (CPU) MoE blocks, their AFD twins, and split runs of them.

Used by this package's tests and by cross-package integration tests (for example the
Ascend paths over the CAM connectors' fake operators). Everything runs real vLLM code;
torch and vLLM are imported inside the functions, so importing this module is cheap.

The blocks are the model families': each model package describes its MoE block as a
:class:`BlockRecipe` (vLLM's class, a small HF config) and names them in its family
(entry point group ``afd.families``, ``test_blocks()``); :meth:`MoEEnv.build_block` takes a
recipe or its name (the model packages' READMEs list theirs), looked up among the
installed families. Nothing here knows a family.

Typical use (one VllmConfig per test session, see :func:`session_vllm_config`)::

    with session_vllm_config() as config:
        env = MoEEnv(config)
        native = env.load(env.build_block(BLOCK_NAME, torch.float32, prefix=...), ckpt)
        twin = env.load(env.build_block(..., factory=afd_moe_factory(afd_config)), ckpt)
        assert torch.equal(env.split_forward(twin, FFNLayerCompute({6: native}), x),
                           env.native_forward(native, x))
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "FAMILY_GROUP",
    "BlockRecipe",
    "MoEEnv",
    "PiecewiseGraphStandIn",
    "block_recipe",
    "model_dtype",
    "session_vllm_config",
]

FAMILY_GROUP = "afd.families"
"""The entry point group of the model families (one per model package): each names an
object with a ``test_blocks()`` returning its :class:`BlockRecipe` objects by name."""


@dataclass(frozen=True)
class BlockRecipe:
    """How to build one family's MoE block with vLLM's own class: a model package's
    (each model package's ``testing`` module)."""

    name: str
    """What tests call it (``MoEEnv.build_block(name, ...)``)."""
    architecture: str
    """The model architecture a build reports (the connectors' start-up checks read it)."""
    module: str
    """vLLM's model module of the block: its ``FusedMoEFactory`` is what a test's
    factory replaces."""
    hf_config: Callable[[], Any]
    """The (small) HF config the block is built from."""
    make: Callable[[Any, Any, Any, str], Any]
    """``(vLLM model module, vllm_config, hf_config, prefix) -> block``."""


def block_recipe(name: str) -> BlockRecipe:
    """The :class:`BlockRecipe` called ``name`` among the installed families' test blocks
    (entry point group :data:`FAMILY_GROUP`); ValueError naming the known ones."""
    from importlib.metadata import entry_points

    known: dict[str, BlockRecipe] = {}
    for ep in entry_points(group=FAMILY_GROUP):
        blocks = getattr(ep.load(), "test_blocks", None)
        known.update(blocks() if blocks is not None else {})
    if name not in known:
        raise ValueError(
            f"unknown test block {name!r}; the installed families have: "
            f"{', '.join(sorted(known)) or 'none'} (entry point group {FAMILY_GROUP})"
        )
    return known[name]


@contextlib.contextmanager
def session_vllm_config() -> Iterator[Any]:
    """A default VllmConfig made current, with a 1-rank gloo world initialised.

    vLLM keeps its layer registry on the VllmConfig the layers were built under, and
    the MoE forward looks runners up there: build every block of a session under this
    one config and run every forward in :meth:`MoEEnv.forward_context`. An already
    initialised 1-rank world (another session in the same process) is reused.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    config = VllmConfig()
    with set_current_vllm_config(config), tempfile.NamedTemporaryFile() as rendezvous:
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{rendezvous.name}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        yield config


@contextlib.contextmanager
def model_dtype(
    config: Any, dtype: Any, hf_text_config: Any = None, architecture: str = ""
) -> Iterator[None]:
    """Build layers as a model of ``dtype`` would be built (default dtype + model_config).

    The session config has no ModelConfig (that would need a checkpoint on disk);
    the blocks read only ``dtype`` and ``hf_text_config`` from it, the connectors'
    start-up checks the model's ``architectures``.
    """
    import types

    import torch

    previous_default = torch.get_default_dtype()
    previous_model_config = config.model_config
    stand_in = types.SimpleNamespace(
        dtype=dtype,
        hf_text_config=hf_text_config,
        architectures=[architecture] if architecture else [],
    )
    object.__setattr__(config, "model_config", stand_in)
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous_default)
        object.__setattr__(config, "model_config", previous_model_config)


class MoEEnv:
    """Builds native vLLM blocks and their Attention-side AFD twins; runs them split.

    A block is a family's :class:`BlockRecipe`, or its name (:func:`block_recipe`; the
    model packages' READMEs list theirs).
    """

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self._ports = iter(range(41000, 42000))

    # -- building --------------------------------------------------------------------
    def build_block(
        self,
        family: str | BlockRecipe,
        dtype: Any,
        prefix: str,
        factory: Any = None,
        architecture: str = "",
    ) -> Any:
        """A block of ``family`` (a :class:`BlockRecipe` or its name) built under
        ``prefix``; ``factory`` replaces FusedMoEFactory.

        ``architecture``: the model architecture the build reports (default: the family's).
        """
        from unittest import mock

        recipe = block_recipe(family) if isinstance(family, str) else family
        module = importlib.import_module(recipe.module)
        hf = recipe.hf_config()
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                model_dtype(self.vllm_config, dtype, hf, architecture or recipe.architecture)
            )
            if factory is not None:
                stack.enter_context(mock.patch.object(module, "FusedMoEFactory", factory))
            return recipe.make(module, self.vllm_config, hf, prefix)

    @staticmethod
    def checkpoint_for(block: Any, seed: int) -> dict[str, Any]:
        """Seeded random "checkpoint" tensors for every parameter of ``block``."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        weights = {}
        for name, param in block.named_parameters():
            scale = 1.0 if name.endswith(("gate.weight", "e_score_correction_bias")) else 0.1
            value = torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale
            weights[name] = value.to(param.dtype)
        return weights

    @staticmethod
    def load(block: Any, checkpoint: dict[str, Any]) -> Any:
        """Copy ``checkpoint`` into ``block`` (every parameter must be found) and finish
        loading as vLLM's loader does (``process_weights_after_loading``)."""
        import torch

        with torch.no_grad():
            for name, param in block.named_parameters():
                param.copy_(checkpoint[name])
        for module in block.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        return block

    # -- running ---------------------------------------------------------------------
    def forward_context(self, num_tokens: int) -> Any:
        from vllm.forward_context import set_forward_context

        return set_forward_context(None, self.vllm_config, num_tokens=num_tokens)

    def native_forward(self, block: Any, x: Any) -> Any:
        import torch

        with torch.no_grad(), self.forward_context(x.shape[0]):
            return block(x.clone())

    def connector_pair(self) -> tuple[Any, Any]:
        """An initialised loopback (Attention, FFN) connector pair on a fresh address."""
        from afd_core.config import AFDConfig, AFDRole
        from afd_core.testing.loopback import register_loopback

        loopback = register_loopback()  # afd-core's in-process test double
        port = next(self._ports)
        pair = []
        for role in (AFDRole.ATTENTION, AFDRole.FFN):
            config = AFDConfig(
                role=role,
                connector=loopback.name,
                host="afd-moe-tests",
                port=port,
                transfer_timeout_s=60.0,
            )
            connector = loopback(config, rank=0)
            connector.init()
            pair.append(connector)
        return pair[0], pair[1]

    def split_forward(
        self,
        attention_module: Any,
        ffn_compute: Any,
        x: Any,
        *,
        micro_batch_idx: int = 0,
        num_micro_batches: int = 1,
        num_tokens: int | None = None,
        connectors: tuple[Any, Any] | None = None,
    ) -> Any:
        """Attention side in this thread, FFN side (one layer) in another.

        ``connectors``: an initialised (Attention, FFN) pair to run over (default: a
        fresh loopback pair); either way both are closed when the run ends.

        vLLM's CPU kernels are not safe to run from two threads at once (a concurrent
        shared-expert GEMM and fused-MoE kernel segfault in cpu_fused_moe), which two
        real role processes never do. So the FFN thread starts computing only once the
        Attention side reached its micro-batch yield point (after the send and any
        local shared experts), through that same public hook.
        """
        import threading

        import torch
        from vllm.forward_context import get_forward_context

        from afd_core.forward_context import AFDStepMetadata, set_step_metadata

        attention, ffn = connectors if connectors is not None else self.connector_pair()
        failure: list[BaseException] = []
        attention_idle = threading.Event()
        hooked = [m for m in attention_module.modules() if hasattr(m, "micro_batch_yield")]
        assert len(hooked) == 1, "expected exactly one AFD layer in the Attention module"
        original_yield = hooked[0].micro_batch_yield

        def yield_point(layer_idx: int, mb: int) -> None:
            original_yield(layer_idx, mb)
            attention_idle.set()

        def serve() -> None:
            try:
                batch = ffn.recv_from_attention(timeout_s=60.0)
                if not attention_idle.wait(timeout=60.0):
                    raise TimeoutError("the Attention side never reached its yield point")
                result = ffn_compute.compute(batch.layer_idx, batch.payload)
                ffn.send_to_attention(batch, result)
            except BaseException as exc:  # re-raised in the test thread
                failure.append(exc)

        server = threading.Thread(target=serve, name="afd-ffn", daemon=True)
        server.start()
        hooked[0].micro_batch_yield = yield_point
        try:
            with torch.no_grad(), self.forward_context(x.shape[0]):
                set_step_metadata(
                    get_forward_context(),
                    AFDStepMetadata(
                        connector=attention,
                        micro_batch_idx=micro_batch_idx,
                        num_micro_batches=num_micro_batches,
                        num_tokens=num_tokens,
                    ),
                )
                out = attention_module(x.clone())
        finally:
            hooked[0].micro_batch_yield = original_yield
            # Closing the Attention side first unblocks a server still waiting after a
            # failure here; after a success the server has already answered.
            attention.close()
            server.join(timeout=60.0)
            ffn.close()
        if failure:
            raise failure[0]
        return out


class PiecewiseGraphStandIn:
    """A CPU stand-in for vLLM's ``CUDAGraphWrapper`` around one piece of a piecewise
    compiled graph (vLLM builds it through ``current_platform.get_static_graph_wrapper_cls``
    with the same arguments), keeping the contract a CUDA graph imposes:

    * the first call in ``PIECEWISE`` mode for a batch descriptor is the *capture*: the
      piece runs, its tensor inputs' addresses and the tensors themselves are kept, and
      its float outputs are filled with NaN afterwards (a capture records kernels without
      running them: what the eager code between two pieces reads during a capture is
      uninitialised memory);
    * every later call for that descriptor is a *replay*: a graph reads the addresses it
      captured, whatever the caller passes, and writes its outputs where it wrote them at
      capture. So the piece runs on the captured inputs, its results are copied into the
      captured outputs, and those are returned. An input at another address than at
      capture is recorded in :attr:`mismatches` (what vLLM checks with
      ``VLLM_LOGGING_LEVEL=DEBUG`` on CUDA): its data never reaches the graph;
    * any other mode (NONE, or a FULL mode) runs the piece directly, as vLLM's wrapper.

    :attr:`instances` lists every stand-in made (in piece order); :attr:`modes` of each
    records the runtime mode of every call.
    """

    instances: ClassVar[list[PiecewiseGraphStandIn]] = []

    def __init__(
        self, runnable: Any, vllm_config: Any, runtime_mode: Any, cudagraph_options: Any = None
    ) -> None:
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.entries: dict[Any, tuple[list[int], tuple[Any, ...], Any]] = {}
        self.mismatches: list[tuple[Any, list[int]]] = []
        self.modes: list[str] = []
        PiecewiseGraphStandIn.instances.append(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runnable"], name)

    def __call__(self, *args: Any) -> Any:
        import torch
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        mode = ctx.cudagraph_runtime_mode
        self.modes.append(mode.name)
        if mode != self.runtime_mode:
            return self.runnable(*args)
        key = ctx.batch_descriptor
        addresses = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        entry = self.entries.get(key)
        if entry is None:
            output = self.runnable(*args)
            for t in _tensors(output):
                if t.is_floating_point():
                    t.fill_(float("nan"))
            self.entries[key] = (addresses, args, output)
            return output
        captured, inputs, output = entry
        if addresses != captured:
            self.mismatches.append(
                (
                    key,
                    [
                        i
                        for i, (a, b) in enumerate(zip(addresses, captured, strict=False))
                        if a != b
                    ],
                )
            )
        fresh = self.runnable(*inputs)
        for target, value in zip(_tensors(output), _tensors(fresh), strict=True):
            target.copy_(value)
        return output


def _tensors(value: Any) -> list[Any]:
    import torch

    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor)]
