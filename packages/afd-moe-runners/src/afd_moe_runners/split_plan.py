"""How a vLLM MoE model splits into an Attention role and an FFN role, read off vLLM's
own model rather than written per family.

:func:`dry_build` constructs the native model class on PyTorch's ``meta`` device (no
weights are allocated; the vLLM config's per-layer registries are private copies, so
nothing leaks into the real build) and :func:`plan_split` reads its module tree:

* the decoder layers are the ``nn.ModuleList`` holding the MoE layers vLLM built with
  ``FusedMoEFactory`` (its ``MoERunner`` modules);
* in each decoder layer, the child holding an attention or recurrent-state layer
  (vLLM's ``AttentionLayerBase``: full, MLA, sliding, linear attention, Mamba) belongs
  to the Attention role; the child holding the ``MoERunner`` is the layer's FFN block,
  and in a layer without one, the parameterised child under the same attribute name is
  its dense MLP; norms stay on both roles;
* in a MoE block, the router is the gate module the runner was given, or a linear
  child with one output per expert; any other parameterised child (shared experts,
  their gates) is computed by the FFN role.

Anything that fits none of these (a parameterised child that is neither attention, the
FFN block nor a norm; MoE layers in two layer lists; a child holding both attention and
experts) makes the model unsupported, with the reason per layer, instead of guessing.
The plan says which module to build, replace or drop per role
(:mod:`afd_moe_runners.generic`), which role owns each checkpoint tensor, and how to
take a role's parameter inventory.

Over 400 lines on purpose: the split rules and their refusal messages are one decision
procedure, read together.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from afd_core.weights import WeightOwner

__all__ = [
    "LayerPlan",
    "SplitPlan",
    "dry_build",
    "meta_tensors",
    "plan_split",
]

_NORM = re.compile(r"norm", re.IGNORECASE)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: what runs where.

    ``kind``: ``"moe"`` (an FFN block with routed experts), ``"dense"`` (a dense MLP on
    the FFN role), ``"attention-only"`` (no FFN block) or ``"unsupported"`` (``reason``).
    """

    index: int
    prefix: str
    kind: str
    attention: tuple[str, ...] = ()
    ffn: str | None = None
    ffn_class: str = ""
    reason: str = ""

    def describe(self) -> str:
        where = f"layer {self.index:>3} {self.kind:<14}"
        if self.kind == "unsupported":
            return f"{where} {self.reason}"
        parts = [f"attention: {', '.join(self.attention) or '-'}"]
        if self.ffn:
            parts.append(f"FFN: {self.ffn} ({self.ffn_class})")
        return f"{where} " + "; ".join(parts)


@dataclass(frozen=True)
class SplitPlan:
    """The AFD split of one model class under one config (see the module docstring)."""

    architecture: str
    layers_prefix: str
    layers: tuple[LayerPlan, ...]
    #: Children of a MoE block holding its router, and its other parameterised children
    #: (shared experts and their gates: the FFN role computes them).
    gate_attrs: frozenset[str] = frozenset()
    #: Children of a MoE block holding the runner (routed experts).
    expert_attrs: frozenset[str] = frozenset()
    moe_extra_attrs: frozenset[str] = frozenset()
    #: Children of MoE blocks that are whole modules (shared experts): the Attention
    #: role does not build them at all; leaf extras (a shared-expert gate) are dropped
    #: after construction.
    moe_extra_modules: frozenset[str] = frozenset()
    #: Module paths of the token embedding and LM head (Attention role only).
    embedding_prefixes: tuple[str, ...] = ()
    lm_head_prefixes: tuple[str, ...] = ()
    #: Classes built at the places above, per kind (intercepted by their module names).
    attention_classes: tuple[type, ...] = ()
    ffn_classes: tuple[type, ...] = ()
    embedding_classes: tuple[type, ...] = ()
    #: vLLM model-definition modules (and the native class's own) whose global names
    #: are replaced for the duration of the constructor.
    modules: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())

    @property
    def supported(self) -> bool:
        return not self.problems

    @functools.cached_property
    def _by_index(self) -> dict[int, LayerPlan]:
        return {layer.index: layer for layer in self.layers}

    @functools.cached_property
    def _embedding_paths(self) -> tuple[str, ...]:
        return (*self.embedding_prefixes, *self.lm_head_prefixes)

    # ------------------------------------------------------------- module paths

    def attention_prefixes(self) -> frozenset[str]:
        return frozenset(
            f"{layer.prefix}.{attr}" for layer in self.layers for attr in layer.attention
        )

    def dense_prefixes(self) -> dict[str, int]:
        """Module path of each dense MLP -> its layer index."""
        return {
            f"{layer.prefix}.{layer.ffn}": layer.index
            for layer in self.layers
            if layer.kind == "dense"
        }

    def moe_prefixes(self) -> dict[str, int]:
        """Module path of each MoE block -> its layer index."""
        return {
            f"{layer.prefix}.{layer.ffn}": layer.index
            for layer in self.layers
            if layer.kind == "moe"
        }

    def ffn_blocks(self, model: nn.Module) -> dict[int, nn.Module]:
        """Decoder-layer index -> that layer's FFN block (MoE block or dense MLP)."""
        return {
            layer.index: model.get_submodule(f"{layer.prefix}.{layer.ffn}")
            for layer in self.layers
            if layer.kind in ("moe", "dense") and layer.ffn
        }

    # ---------------------------------------------------------------- ownership

    def category(self, name: str) -> str:
        """Category of a parameter or module path of the built model (inventory).

        Called for every parameter and every checkpoint tensor: the decoder layer is
        looked up by the index in the path, not searched for."""
        head = f"{self.layers_prefix}."
        if self.layers_prefix and name.startswith(head):
            index, _, in_layer = name[len(head) :].partition(".")
            layer = self._by_index.get(int(index)) if index.isdigit() else None
            if layer is None:
                return "other"
            child, _, rest = in_layer.partition(".")
            if child in layer.attention:
                return "attention"
            if child == layer.ffn and layer.kind == "dense":
                return "dense_mlp"
            if child == layer.ffn and layer.kind == "moe":
                sub = rest.partition(".")[0]
                if sub in self.gate_attrs:
                    return "gate"
                if sub in self.moe_extra_attrs:
                    return "shared_experts"
                if sub in self.expert_attrs:
                    return "routed_experts"
                return "moe_other"
            return "other"
        if any(name == p or name.startswith(f"{p}.") for p in self._embedding_paths):
            return "embedding"
        return "other"

    def inventory(self, model: nn.Module) -> dict[str, int]:
        """Number of parameters (tensors) per category, as ``parameter_inventory``."""
        counts: Counter[str] = Counter(self.category(n) for n, _ in model.named_parameters())
        counts["total"] = sum(counts.values())
        return dict(counts)

    def owner(
        self,
        vllm_name: str,
        *,
        gate_on_attention: bool,
        dense_on_attention: bool = False,
        shared_on_attention: bool = False,
    ) -> WeightOwner:
        """Which role loads the checkpoint tensor at vLLM path ``vllm_name``.

        Attention (and recurrent state), embedding and LM head: Attention. FFN blocks:
        FFN, except the router with the gate on Attention: both (the FFN role keeps the
        native block); a block tensor that is none of its modules (vLLM's loader renames
        it): as the router. Dense MLPs with ``dense_on_attention`` and shared experts with
        ``shared_on_attention`` (:mod:`afd_moe_runners.builder`): Attention, which builds
        and runs them. Norms and anything else: both (each native loader skips what it
        did not build).
        """
        category = self.category(vllm_name)
        if category in ("attention", "embedding"):
            return WeightOwner.ATTENTION
        if (category == "dense_mlp" and dense_on_attention) or (
            category == "shared_experts" and shared_on_attention
        ):
            return WeightOwner.ATTENTION
        if category in ("routed_experts", "shared_experts", "dense_mlp"):
            return WeightOwner.FFN
        if category in ("gate", "moe_other"):
            # moe_other: a block tensor vLLM's loader renames into the block (e.g. a
            # router bias stored beside the gate): the router's owner(s), to be safe.
            return WeightOwner.BOTH if gate_on_attention else WeightOwner.FFN
        return WeightOwner.BOTH

    def report(self) -> str:
        """A readable summary, one line per layer (``afd models check``)."""
        lines = [f"{self.architecture}: decoder layers at {self.layers_prefix or '?'}"]
        lines += [f"  {layer.describe()}" for layer in self.layers]
        if self.gate_attrs:
            lines.append(f"  MoE router: {', '.join(sorted(self.gate_attrs))}")
        if self.moe_extra_attrs:
            lines.append(
                f"  MoE block extras on the FFN role: {', '.join(sorted(self.moe_extra_attrs))}"
            )
        lines += [f"  unsupported: {p}" for p in self.problems]
        return "\n".join(lines)


# ----------------------------------------------------------------------- dry build


def dry_build(model_cls: type[nn.Module], vllm_config: Any, prefix: str = "") -> nn.Module:
    """``model_cls`` built on the ``meta`` device (no weights allocated).

    Layers register themselves in the compilation config's per-layer tables while they
    are built; the dry build gets private copies, so the real build that follows sees
    nothing of it.
    """
    import torch
    from vllm.config import set_current_vllm_config

    dry = copy.copy(vllm_config)
    dry.compilation_config = copy.copy(vllm_config.compilation_config)
    cc = dry.compilation_config
    for attr, value in list(vars(cc).items()):
        if attr.startswith("static_") and isinstance(value, dict | list | set):
            setattr(cc, attr, type(value)())
    with set_current_vllm_config(dry), torch.device("meta"), _private_layer_caches():
        return model_cls(vllm_config=dry, prefix=prefix)


@contextlib.contextmanager
def _private_layer_caches() -> Iterator[None]:
    """vLLM's process-wide caches of built layers (``get_rope`` reuses one rotary
    embedding per configuration) get back their content afterwards: a layer made on
    ``meta`` must never be handed to the real build."""
    from vllm.model_executor.layers import rotary_embedding

    saved = dict(rotary_embedding._ROPE_DICT)
    try:
        yield
    finally:
        rotary_embedding._ROPE_DICT.clear()
        rotary_embedding._ROPE_DICT.update(saved)


def meta_tensors(model: nn.Module) -> list[str]:
    """Parameters and buffers of ``model`` left on the ``meta`` device (a layer of a
    dry build reused through a cache this module does not know)."""
    return [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if t.device.type == "meta"
    ]


# ------------------------------------------------------------------------- analysis


def _attention_base() -> type:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return AttentionLayerBase


def _runner_base() -> type:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunnerInterface

    return MoERunnerInterface


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _contains(module: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in module.modules())


def _is_norm(module: nn.Module) -> bool:
    return bool(_NORM.search(type(module).__name__)) and not any(
        _has_params(c) for c in module.children()
    )


def _layer_list(model: nn.Module, path: str) -> tuple[str, int, str] | None:
    """(list path, index, child attribute) of the decoder layer holding ``path``."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if not parts[i].isdigit() or i + 1 >= len(parts):
            continue
        parent = ".".join(parts[:i])
        if isinstance(model.get_submodule(parent), nn.ModuleList):
            return parent, int(parts[i]), parts[i + 1]
    return None


def _out_features(module: nn.Module) -> int | None:
    for attr in ("output_size", "out_features"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if getattr(weight, "ndim", 0) == 2 else None


def _num_experts(runner: nn.Module) -> int | None:
    moe_config = getattr(runner, "moe_config", None)
    for attr in ("num_experts", "num_logical_experts", "global_num_experts"):
        value = getattr(moe_config, attr, None)
        if isinstance(value, int):
            return value
    return None


def _definition_modules(model: nn.Module) -> tuple[str, ...]:
    """Modules defining the model's own classes and their bases (not vLLM's layer
    library or torch)."""
    library = ("torch.", "vllm.model_executor.layers.", "vllm.attention.", "vllm.v1.")
    names: dict[str, None] = {}
    for module in model.modules():
        # Base classes too: a subclass's constructor may run its base's (another module).
        for cls in type(module).__mro__:
            names.setdefault(cls.__module__, None)
    return tuple(
        n for n in names if not n.startswith(library) and n not in ("builtins", "abc", "typing")
    )


def plan_split(model: nn.Module, architecture: str) -> SplitPlan:
    """Read the split of ``model`` (a native model, typically from :func:`dry_build`)."""
    attention_base, runner_base = _attention_base(), _runner_base()
    problems: list[str] = []
    runners = [(n, m) for n, m in model.named_modules() if isinstance(m, runner_base)]
    if not runners:
        return SplitPlan(
            architecture,
            "",
            (),
            problems=(
                "no MoE layer: vLLM builds no FusedMoE (MoERunner) module for this model, "
                "so there is nothing to run on an FFN role (a dense model?)",
            ),
            modules=_definition_modules(model),
        )
    lists = {}
    for name, _ in runners:
        where = _layer_list(model, name)
        if where is None:
            problems.append(f"MoE layer {name} is not inside a list of decoder layers")
            continue
        lists.setdefault(where[0], set()).add(where[2])
    if len(lists) != 1:
        problems.append(f"MoE layers in {len(lists)} layer lists ({sorted(lists)})")
        return SplitPlan(architecture, "", (), problems=tuple(problems))
    layers_prefix, ffn_attrs = next(iter(lists.items()))
    if len(ffn_attrs) != 1:
        problems.append(f"MoE blocks under several attributes of a decoder layer: {ffn_attrs}")
    ffn_attr = sorted(ffn_attrs)[0]

    from vllm.model_executor.models.utils import PPMissingLayer

    layers: list[LayerPlan] = []
    gate_attrs: set[str] = set()
    expert_attrs: set[str] = set()
    extra_attrs: set[str] = set()
    extra_modules: set[str] = set()
    attention_classes: dict[type, None] = {}
    ffn_classes: dict[type, None] = {}
    for idx, layer in enumerate(model.get_submodule(layers_prefix)):
        if isinstance(layer, PPMissingLayer):
            continue
        prefix = f"{layers_prefix}.{idx}"
        attention: list[str] = []
        ffn: str | None = None
        kind = "attention-only"
        reason = ""
        for attr, child in layer.named_children():
            has_attention = _contains(child, attention_base)
            has_runner = _contains(child, runner_base)
            if has_attention and has_runner:
                reason = f"{attr} ({type(child).__name__}) holds both attention and experts"
            elif has_attention:
                attention.append(attr)
                attention_classes.setdefault(type(child), None)
            elif has_runner or (attr == ffn_attr and _has_params(child)):
                ffn = attr
                kind = "moe" if has_runner else "dense"
                if kind == "dense":
                    ffn_classes.setdefault(type(child), None)
                else:
                    _read_moe_block(
                        child, gate_attrs, expert_attrs, extra_attrs, extra_modules, ffn_classes
                    )
            elif _has_params(child) and not _is_norm(child):
                reason = (
                    f"{attr} ({type(child).__name__}) is neither attention, the FFN block "
                    f"({ffn_attr}) nor a norm; afd cannot tell which role runs it"
                )
        if not attention and not reason:
            reason = "no attention layer in this decoder layer"
        if reason:
            kind = "unsupported"
            problems.append(f"layer {idx}: {reason}")
        layers.append(
            LayerPlan(
                idx,
                prefix,
                kind,
                tuple(attention),
                ffn,
                type(layer.get_submodule(ffn)).__name__ if ffn else "",
                reason,
            )
        )

    embedding_classes: dict[type, None] = {}
    embeddings: list[str] = []
    lm_heads: list[str] = []
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    for name, module in model.named_modules():
        if name.startswith(f"{layers_prefix}."):
            continue
        if isinstance(module, ParallelLMHead):
            lm_heads.append(name)
            embedding_classes.setdefault(type(module), None)
        elif isinstance(module, VocabParallelEmbedding):
            embeddings.append(name)
            embedding_classes.setdefault(type(module), None)
    return SplitPlan(
        architecture=architecture,
        layers_prefix=layers_prefix,
        layers=tuple(layers),
        gate_attrs=frozenset(gate_attrs),
        expert_attrs=frozenset(expert_attrs),
        moe_extra_attrs=frozenset(extra_attrs),
        moe_extra_modules=frozenset(extra_modules),
        embedding_prefixes=tuple(embeddings),
        lm_head_prefixes=tuple(lm_heads),
        attention_classes=tuple(attention_classes),
        ffn_classes=tuple(ffn_classes),
        embedding_classes=tuple(embedding_classes),
        modules=_definition_modules(model),
        problems=tuple(problems),
    )


def _read_moe_block(
    block: nn.Module,
    gate_attrs: set[str],
    expert_attrs: set[str],
    extra_attrs: set[str],
    extra_modules: set[str],
    ffn_classes: dict[type, None],
) -> None:
    """Sort the children of one MoE block: runner, router, extras (shared experts)."""
    runner_base = _runner_base()
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    runner = next(m for m in block.modules() if isinstance(m, runner_base))
    given_gate = runner._modules.get("gate")
    num_experts = _num_experts(runner)
    for attr, child in block.named_children():
        if _contains(child, runner_base):
            expert_attrs.add(attr)
            continue
        if not _has_params(child):
            continue
        if (
            child is given_gate
            or isinstance(child, GateLinear)
            or (num_experts is not None and _out_features(child) == num_experts)
        ):
            gate_attrs.add(attr)
            continue
        extra_attrs.add(attr)
        if any(_has_params(c) for c in child.children()):
            extra_modules.add(attr)
            ffn_classes.setdefault(type(child), None)
