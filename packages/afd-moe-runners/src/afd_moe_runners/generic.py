"""Any vLLM MoE model as an AFD role model, with no code per family.

``AFD<Architecture>`` (e.g. ``AFDMixtralForCausalLM``) is made on first use from vLLM's
own ``<Architecture>`` class: :func:`role_model_class`, or this module's attribute of
that name, which is what the vLLM plugin registers lazily for every architecture
without a hand-written wrapper. Its constructor

1. builds the native model once on the ``meta`` device and reads the split from it
   (:func:`afd_moe_runners.split_plan.plan_split`: which decoder-layer children are
   attention, which are FFN blocks, routers, shared experts; the embedding and LM
   head), and refuses a model it cannot split, naming the layer and the reason;
2. builds the native model for its role, with the classes found in step 1 replaced
   for the constructor's duration in the model's own modules
   (:func:`afd_core.patching.scoped_globals`), decided per module path: on the
   Attention role ``FusedMoEFactory`` builds the AFD runner, dense MLPs become
   parameter-free :class:`~afd_moe_runners.dense.RemoteDenseMLP` stand-ins and shared
   experts parameter-free placeholders (dropped after construction); on the FFN role
   attention / recurrent layers, the embedding and the LM head are parameter-free
   placeholders. Where the role's deployment plan puts the dense layers or the shared
   experts on the Attention role (:class:`~afd_moe_runners.deployment_plan.DeploymentPlan`,
   resolved once at start-up by :func:`~afd_moe_runners.start_up.start_role`), that role
   builds them natively and the FFN role gets the placeholders instead;
3. drops what the Attention role's MoE blocks must not own (shared-expert gates, unless
   the shared experts run there; the router when the gate runs on FFN, replaced by
   :class:`~afd_moe_runners.placeholders.NoGate`), and checks each role's parameter
   inventory against the plan.

Checkpoint tensors are assigned to roles by the same plan (vLLM paths after the
model's own ``hf_to_vllm_mapper``), so no per-family weight table exists either.

Over 400 lines on purpose: the three construction steps share one scoped replacement of
the model module's globals and one plan; split, one constructor would span modules.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError
from afd_core.patching import scoped_globals
from afd_core.weights import WeightOwner
from afd_moe_runners.dense import RemoteDenseMLP
from afd_moe_runners.deployment_plan import DeploymentPlan
from afd_moe_runners.placeholders import (
    NoAttention,
    NoGate,
    NoLMHead,
    attention_factory,
    expert_shard_factory,
)
from afd_moe_runners.role_model import AFDRoleModel
from afd_moe_runners.role_runtime import RoleRuntime
from afd_moe_runners.split_plan import SplitPlan, dry_build, meta_tensors, plan_split
from afd_moe_runners.start_up import afd_config_of, start_role

logger = logging.getLogger(__name__)

__all__ = [
    "ALIAS_PREFIX",
    "GenericRoleModel",
    "afd_alias",
    "classify_weight",
    "native_model_class",
    "role_model_class",
    "split_plan_of",
]

#: ``AFD<Architecture>``: the alias of an architecture's role-aware class.
ALIAS_PREFIX = "AFD"


def afd_alias(architecture: str) -> str:
    return f"{ALIAS_PREFIX}{architecture}"


def native_model_class(architecture: str) -> type[nn.Module]:
    """vLLM's model class registered for ``architecture``; clear error when unknown."""
    from afd_moe_runners._vllm_compat import load_registered_model_class

    cls = load_registered_model_class(architecture)
    if cls is None:
        raise AFDConfigError(
            f"vLLM has no model architecture {architecture!r} (see vLLM's supported "
            "models); afd splits architectures vLLM itself can build"
        )
    return cls


def split_plan_of(native: type[nn.Module], vllm_config: VllmConfig, prefix: str = "") -> SplitPlan:
    """The split of ``native`` under ``vllm_config`` (a dry build on ``meta``)."""
    architecture = native.__name__
    return plan_split(dry_build(native, vllm_config, prefix), architecture)


class _Intercepted:
    """Stands in for a class in a model module during construction: the instances at
    the given module paths (``prefix=`` argument) come from ``make``, the others from
    the class itself; ``isinstance`` / ``issubclass`` checks against it see the class.

    Some constructors pass no ``prefix`` (vLLM builds most token embeddings without
    one): when the class has a single path to replace, its first prefix-less instance
    is that one. A guess that is wrong shows in the role's parameter inventory check.
    """

    def __init__(self, cls: type, make: dict[str, Callable[[str], Any]]) -> None:
        self.cls = cls
        self.make = make
        self.unnamed = next(iter(make.items())) if len(make) == 1 else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prefix = kwargs.get("prefix")
        if isinstance(prefix, str) and prefix in self.make:
            return self.make[prefix](prefix)
        if not prefix and self.unnamed is not None:
            path, make = self.unnamed
            self.unnamed = None
            return make(path)
        return self.cls(*args, **kwargs)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.cls)

    def __subclasscheck__(self, sub: type) -> bool:
        return issubclass(sub, self.cls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cls, name)


@functools.cache
def _remote_dense_class(cls: type) -> type:
    """A parameter-free :class:`RemoteDenseMLP` that is also an instance of ``cls`` (the
    decoder layer's ``isinstance`` checks, e.g. fp16 rescaling, behave natively)."""

    def __init__(self: Any, layer_idx: int) -> None:
        nn.Module.__init__(self)  # not cls.__init__: it would build the weights
        RemoteDenseMLP._init_remote(self, layer_idx, None)

    return type(
        f"Remote{cls.__name__}",
        (RemoteDenseMLP, cls),
        {"__init__": __init__, "__module__": __name__},
    )


@functools.cache
def _absent_class(cls: type, computed_by: AFDRole = AFDRole.FFN) -> type:
    """A parameter-free stand-in that is an instance of ``cls``, for a module this role
    must not build because the ``computed_by`` role runs it (a shared expert on the
    Attention role; a dense MLP or shared expert on the FFN role where the Attention
    role computes those): the constructor around it still sees a module where the
    native one would be (vLLM's blocks decide other arguments on ``is None``)."""
    here = AFDRole.ATTENTION if computed_by is AFDRole.FFN else AFDRole.FFN

    def __init__(self: Any, prefix: str) -> None:
        nn.Module.__init__(self)  # not cls.__init__: it would build the weights
        self.afd_prefix = prefix

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.afd_prefix}: the {computed_by.value} role computes this module; it must "
            f"not run on the AFD {here.value} role"
        )

    return type(
        f"Absent{cls.__name__}",
        (cls,),
        {"__init__": __init__, "forward": forward, "__module__": __name__},
    )


def _shared_prefixes(plan: SplitPlan) -> list[str]:
    return [f"{m}.{attr}" for m in plan.moe_prefixes() for attr in plan.moe_extra_modules]


def _interceptions(
    plan: SplitPlan, deployment: DeploymentPlan
) -> dict[type, dict[str, Callable[[str], Any]]]:
    """Per class to intercept: module path -> what to build there instead. Where the
    dense layers and shared experts go is the role's deployment plan's decision (on cpu /
    cuda the FFN role computes both)."""
    out: dict[type, dict[str, Callable[[str], Any]]] = {}
    dense_here = deployment.dense_layers_on_attention
    shared_here = deployment.shared_experts_on_attention
    if deployment.role is AFDRole.FFN:
        # What the Attention role computes (connector without hidden-only payloads; NPU
        # runners with the gate on Attention): not built here.
        local = ([*plan.dense_prefixes()] if dense_here else []) + (
            _shared_prefixes(plan) if shared_here else []
        )
        for cls in plan.ffn_classes if local else ():
            out[cls] = dict.fromkeys(
                local, lambda p, cls=cls: _absent_class(cls, AFDRole.ATTENTION)(p)
            )
        for cls in plan.attention_classes:
            out[cls] = dict.fromkeys(plan.attention_prefixes(), lambda p: NoAttention(prefix=p))
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        for cls in plan.embedding_classes:
            if issubclass(cls, ParallelLMHead):
                out[cls] = dict.fromkeys(plan.lm_head_prefixes, lambda p: NoLMHead())
            else:
                out[cls] = dict.fromkeys(plan.embedding_prefixes, lambda p: PPMissingLayer())
        return out
    # Built natively where the Attention role computes them (``dense_here``/``shared_here``).
    dense = {} if dense_here else plan.dense_prefixes()
    shared = [] if shared_here else _shared_prefixes(plan)
    for cls in plan.ffn_classes:
        make: dict[str, Callable[[str], Any]] = dict.fromkeys(
            shared, lambda p, cls=cls: _absent_class(cls)(p)
        )
        for path, idx in dense.items():
            make[path] = lambda p, idx=idx, cls=cls: _remote_dense_class(cls)(idx)
        out[cls] = make
    return out


@contextlib.contextmanager
def _role_construction(
    plan: SplitPlan, afd: AFDConfig, deployment: DeploymentPlan, vllm_config: VllmConfig
) -> Iterator[None]:
    """Replace, in the model's own modules, the names of the intercepted classes (and
    ``FusedMoEFactory`` on the Attention role, and on an FFN rank under FFN expert
    parallelism) while the native constructor runs; the factories get the role's
    deployment plan."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    intercepted = _interceptions(plan, deployment)
    attention = deployment.role is AFDRole.ATTENTION
    ffn_factory = None
    if not attention and deployment.ffn_expert_parallel:
        ffn_factory = expert_shard_factory(afd, vllm_config, FusedMoEFactory)

    def substitutions(namespace: dict[str, Any]) -> dict[str, Any]:
        subs: dict[str, Any] = {}
        for attr, value in namespace.items():
            if isinstance(value, type) and value in intercepted:
                subs[attr] = _Intercepted(value, intercepted[value])
            elif value is FusedMoEFactory and attention:
                subs[attr] = attention_factory(deployment, FusedMoEFactory)
            elif value is FusedMoEFactory and ffn_factory is not None:
                subs[attr] = ffn_factory
        return subs

    with contextlib.ExitStack() as stack:
        for name in plan.modules:
            module = sys.modules.get(name)
            if module is None:
                continue
            # Module globals (``Attention(...)``) and the class attributes of the
            # module's own classes (``attention_cls = OAIAttention``, built by
            # ``self.attention_cls(...)``).
            targets: list[Any] = [module]
            targets += [
                v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name
            ]
            for target in targets:
                subs = substitutions(dict(vars(target)))
                if subs:
                    stack.enter_context(scoped_globals(target, subs))
        yield


def _strip_attention_moe(model: nn.Module, plan: SplitPlan, deployment: DeploymentPlan) -> None:
    """Drop what an Attention-role MoE block must not own (built natively, unused)."""
    shared_here = deployment.shared_experts_on_attention
    for path in plan.moe_prefixes():
        block = model.get_submodule(path)
        for attr in () if shared_here else plan.moe_extra_attrs:
            if getattr(block, attr, None) is not None:
                setattr(block, attr, None)
        if not deployment.gate_on_attention:
            for attr in plan.gate_attrs:
                if getattr(block, attr, None) is not None:
                    setattr(block, attr, NoGate())


def _strip_ffn_moe(model: nn.Module, plan: SplitPlan, deployment: DeploymentPlan) -> None:
    """With the shared experts on the Attention role, drop the FFN-role MoE blocks' leaf
    extras (a shared-expert gate: built natively, never run here; whole shared-expert
    modules were not built at all)."""
    if not deployment.shared_experts_on_attention:
        return
    for path in plan.moe_prefixes():
        block = model.get_submodule(path)
        for attr in plan.moe_extra_attrs - plan.moe_extra_modules:
            if getattr(block, attr, None) is not None:
                setattr(block, attr, None)


def _default_prefix(native: type) -> str:
    param = inspect.signature(native.__init__).parameters.get("prefix")
    default = getattr(param, "default", "")
    return default if isinstance(default, str) else ""


class GenericRoleModel(AFDRoleModel):
    """Role-aware construction of any vLLM MoE model (see the module docstring).

    Concrete classes come from :func:`role_model_class`: ``AFD<Arch>`` subclasses this
    and vLLM's ``<Arch>``.
    """

    afd_native_class: ClassVar[type[nn.Module]]
    afd_plan: SplitPlan
    afd_deployment: DeploymentPlan

    def __init__(self, *, vllm_config: VllmConfig, prefix: str | None = None) -> None:
        native = self.afd_native_class
        name = type(self).__name__
        prefix = _default_prefix(native) if prefix is None else prefix
        afd = afd_config_of(vllm_config)
        # The start-up checks, then the role's deployment plan (resolved once, logged).
        deployment = start_role(vllm_config, name, multimodal_capable=_is_multimodal(native))
        plan = split_plan_of(native, vllm_config, prefix)
        if not plan.supported:
            raise AFDConfigError(
                f"{name}: afd cannot split {native.__name__} into Attention and FFN roles: "
                + "; ".join(plan.problems)
            )
        with _role_construction(plan, afd, deployment, vllm_config):
            native.__init__(self, vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        left = meta_tensors(self)  # type: ignore[arg-type]
        if left:
            raise AFDConfigError(
                f"{name}: {len(left)} tensors of the real build are on the meta device "
                f"({left[:3]}...): a layer of the dry build was reused through a cache"
            )
        self.afd_config = afd
        self.afd_plan = plan
        self.afd_deployment = deployment
        if deployment.role is AFDRole.ATTENTION:
            _strip_attention_moe(self, plan, deployment)  # type: ignore[arg-type]
        else:
            _strip_ffn_moe(self, plan, deployment)  # type: ignore[arg-type]
        self.afd_runtime = RoleRuntime(
            self,  # type: ignore[arg-type]
            afd,
            vllm_config,
            inventory=plan.inventory,
            plan=deployment,
        )
        logger.info(
            "AFD %s role of %s from vLLM's own model: %d MoE, %d dense layers",
            afd.role.value,
            native.__name__,
            len(plan.moe_prefixes()),
            len(plan.dense_prefixes()),
        )

    def afd_decoder_layers(self) -> Any:
        return self.get_submodule(self.afd_plan.layers_prefix)  # type: ignore[attr-defined]

    def afd_ffn_blocks(self) -> dict[int, nn.Module]:
        blocks = self.afd_plan.ffn_blocks(self)  # type: ignore[arg-type]
        if self.afd_deployment.dense_layers_on_attention:  # run on the Attention role
            moe = self.afd_plan.moe_prefixes().values()
            blocks = {idx: block for idx, block in blocks.items() if idx in moe}
        return blocks

    def afd_classify_weight(self, name: str) -> WeightOwner:
        deployment = self.afd_deployment
        return classify_weight(
            self.afd_native_class,
            self.afd_plan,
            name,
            gate_on_attention=deployment.gate_on_attention,
            dense_on_attention=deployment.dense_layers_on_attention,
            shared_on_attention=deployment.shared_experts_on_attention,
        )


def classify_weight(
    native: type,
    plan: SplitPlan,
    name: str,
    *,
    gate_on_attention: bool,
    dense_on_attention: bool = False,
    shared_on_attention: bool = False,
) -> WeightOwner:
    """Which role loads checkpoint tensor ``name``: the plan's owner of its vLLM path
    (after the model's own ``hf_to_vllm_mapper``; a name the mapper drops goes to both
    roles, whose native loaders skip it). ``dense_on_attention`` / ``shared_on_attention``:
    the Attention role computes the dense layers / shared experts (see
    :func:`~afd_moe_runners.split_plan.SplitPlan.owner`)."""
    mapper = getattr(native, "hf_to_vllm_mapper", None)
    vllm_name = mapper.map_name(name) if mapper is not None else name
    if vllm_name is None:
        return WeightOwner.BOTH
    return plan.owner(
        vllm_name,
        gate_on_attention=gate_on_attention,
        dense_on_attention=dense_on_attention,
        shared_on_attention=shared_on_attention,
    )


def _is_multimodal(native: type) -> bool:
    from vllm.model_executor.models.interfaces import supports_multimodal

    return bool(supports_multimodal(native))


_classes: dict[str, type] = {}


def role_model_class(architecture: str) -> type:
    """``AFD<architecture>``: the role-aware class of vLLM's ``architecture`` (made once
    per process)."""
    cls = _classes.get(architecture)
    if cls is None:
        native = native_model_class(architecture)
        name = afd_alias(architecture)
        cls = type(
            name,
            (GenericRoleModel, native),
            {"__module__": __name__, "__qualname__": name, "afd_native_class": native},
        )
        _classes[architecture] = cls
    return cls


def __getattr__(name: str) -> Any:
    # vLLM resolves the plugin's lazy "afd_moe_runners.generic:AFD<Arch>" registrations
    # (and pickles the classes) by this module's attributes.
    if name.startswith(ALIAS_PREFIX) and len(name) > len(ALIAS_PREFIX):
        try:
            return role_model_class(name[len(ALIAS_PREFIX) :])
        except AFDConfigError as exc:
            raise AttributeError(str(exc)) from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
