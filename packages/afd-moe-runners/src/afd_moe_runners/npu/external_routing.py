"""FFN side of gate-on-Attention for CAMP2p: routed experts fed with the Attention's routing.

With ``compute_gate_on_attention=true`` on the synchronous CAMP2p path, the FFN role
receives hidden states plus the top-k ids (int32) and weights (float32) the
Attention role selected. On Ascend the routed experts run inside vLLM-Ascend's
comm framework: a comm implementation (``MoECommMethod``) prepares the input
(pads / gathers / shards rows), the quant method dispatches tokens to the experts
through the *forward-context* comm (``_EXTRA_CTX.moe_comm_method``), and the comm
finalizes (reduce-scatters / unpads). :class:`ExternalRoutingMoE` runs that flow with
AFD-owned comm candidates whose prepare step takes the routing as an argument
(``prepare_external``) and returns it aligned with the prepared rows.

Everything here is plain torch behind three small Protocols, so it runs (and is
tested) on CPU:

* :class:`ExternalRoutingComm` -- a comm candidate: ``prepare_finalize.prepare_external``
  and ``finalize``. On Ascend: ``afd_moe_runners.npu.ascend.AFDAllGatherCommImpl`` /
  ``AFDMC2CommImpl``; here: :class:`LocalExternalRoutingComm` (one rank, no DP).
* :class:`CommSlot` -- where the forward context keeps the selected comm type and
  instance. On Ascend: ``afd_moe_runners.npu.ascend.AscendCommSlot``; here:
  :class:`LocalCommSlot`.
* :class:`ExpertsApply` -- runs the routed experts on prepared rows with aligned
  routing, and forgets any per-token state it set (``release``).

No state is stored on upstream objects between calls: the routing is an argument
and a return value, the previous comm is restored and the per-token state is
released on every exit path.

Over 400 lines on purpose: the comm flow, its three Protocols and their CPU stand-ins are
one contract; split apart, the stand-ins would drift from what they stand in for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from afd_core.errors import AFDConfigError, AFDTransferMismatchError

__all__ = [
    "ExternalRouting",
    "ExternalPrepareFinalize",
    "ExternalRoutingComm",
    "CommSlot",
    "ExpertsApply",
    "ExternalRoutingMoE",
    "LocalPrepared",
    "LocalPrepareAndFinalize",
    "LocalExternalRoutingComm",
    "LocalCommSlot",
    "RoutedExpertsApply",
    "pack_routing",
    "unpack_routing",
    "prepare_external_with",
    "MAX_PACKED_EXPERT_ID",
]

MAX_PACKED_EXPERT_ID = 1 << 24
"""Expert ids below this survive the float32 packing of :func:`pack_routing` exactly."""


@dataclass(frozen=True, slots=True)
class ExternalRouting:
    """Top-k routing for a set of rows: ids int32 ``[rows, k]``, weights float32 ``[rows, k]``.

    The weights already carry top-k weighting (renormalisation) and, unless the model
    scales on the output, the routed scaling factor: the FFN side applies neither again.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor

    def __post_init__(self) -> None:
        ids, weights = self.topk_ids, self.topk_weights
        if ids.dtype != torch.int32 or weights.dtype != torch.float32:
            raise AFDTransferMismatchError(
                f"external routing must be int32 ids and float32 weights, got "
                f"{ids.dtype} ids and {weights.dtype} weights"
            )
        if ids.dim() != 2 or ids.shape != weights.shape:
            raise AFDTransferMismatchError(
                f"external routing ids {tuple(ids.shape)} and weights {tuple(weights.shape)} "
                "must both be [rows, top_k]"
            )

    @property
    def num_rows(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


def pack_routing(routing: ExternalRouting) -> torch.Tensor:
    """``[rows, 2k]`` float32: ids (exact below :data:`MAX_PACKED_EXPERT_ID`), then weights.

    A prepare step that pads / gathers / shards a per-row tensor treats this one
    exactly as it treats the activation's rows; zero padding rows unpack to expert 0
    with weight 0, which contributes nothing.
    """
    return torch.cat([routing.topk_ids.to(torch.float32), routing.topk_weights], dim=1)


def unpack_routing(packed: torch.Tensor, top_k: int) -> ExternalRouting:
    """The inverse of :func:`pack_routing` (for rows possibly padded, gathered or sharded)."""
    if packed.dim() != 2 or packed.shape[1] != 2 * top_k:
        raise AFDTransferMismatchError(
            f"packed routing of shape {tuple(packed.shape)} does not hold top_k={top_k} ids "
            "and weights"
        )
    # Contiguous copies: expert kernels index the weights assuming row-major [rows, k]
    # (vLLM's CPU fused MoE silently misreads a strided view).
    return ExternalRouting(
        topk_ids=packed[:, :top_k].to(torch.int32).contiguous(),
        topk_weights=packed[:, top_k:].to(torch.float32).contiguous(),
    )


def prepare_external_with(
    prepare: Callable[..., Any],
    hidden_states: torch.Tensor,
    routing: ExternalRouting,
    **prepare_kwargs: Any,
) -> tuple[Any, ExternalRouting]:
    """Run a native ``prepare(hidden_states, router_logits, ...)`` carrying the routing.

    The routing travels in the per-row ``router_logits`` slot (packed by
    :func:`pack_routing`), so it is padded, gathered and sharded by the native code
    path itself, in the same row order as the activation. Returns the prepare output
    (its ``router_logits`` cleared when it is a dataclass: it holds no logits) and
    the aligned routing.
    """
    if routing.num_rows != hidden_states.shape[0]:
        raise AFDTransferMismatchError(
            f"external routing has {routing.num_rows} rows for {hidden_states.shape[0]} "
            "hidden-state rows"
        )
    output = prepare(hidden_states, pack_routing(routing), **prepare_kwargs)
    aligned = unpack_routing(output.router_logits, routing.top_k)
    prepared_rows = output.hidden_states.shape[0]
    if aligned.num_rows != prepared_rows:
        raise AFDTransferMismatchError(
            f"prepare returned {prepared_rows} hidden-state rows but {aligned.num_rows} "
            "routing rows"
        )
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = dataclasses.replace(output, router_logits=None)
    return output, aligned


# -- the seams -------------------------------------------------------------------------
class ExternalPrepareFinalize(Protocol):
    """The prepare half of a comm candidate, taking the routing explicitly."""

    def prepare_external(
        self, hidden_states: torch.Tensor, routing: ExternalRouting
    ) -> tuple[Any, ExternalRouting]:
        """Prepared input (``.hidden_states``, ``.padded_hidden_states_shape``) and the
        routing aligned with its rows."""
        ...


class ExternalRoutingComm(Protocol):
    """A comm implementation usable for external routing (an AFD-owned candidate)."""

    @property
    def prepare_finalize(self) -> ExternalPrepareFinalize: ...

    def finalize(
        self,
        hidden_states: torch.Tensor,
        reduce_results: bool,
        padded_hidden_states_shape: torch.Size | None = None,
    ) -> torch.Tensor: ...


class CommSlot(Protocol):
    """Where the forward context keeps the natively selected MoE comm."""

    @property
    def comm_type(self) -> Hashable | None:
        """The selected comm type (always set by the native selector)."""
        ...

    comm_method: Any
    """The selected comm instance (may be unset: then :attr:`comm_type` decides)."""


class ExpertsApply(Protocol):
    """Runs the routed experts on prepared rows through the forward-context comm."""

    def apply(self, prepared: Any, routing: ExternalRouting) -> torch.Tensor: ...

    def release(self) -> None:
        """Forget the per-token state ``apply`` set (masks, scales...)."""
        ...


def _comm_type_attribute(comm: Any) -> Hashable | None:
    value = getattr(comm, "comm_type", None)
    return value if isinstance(value, Hashable) else None


class ExternalRoutingMoE:
    """Prepare -> routed experts -> finalize with routing decided on the Attention role.

    Built once per layer at model initialisation with its comm ``candidates`` (comm
    type -> AFD comm instance). Each :meth:`forward`:

    1. picks the candidate of the natively selected comm type (from the context's comm
       instance via ``comm_type_of``; when the instance is unset, from the context's
       comm type); an unsupported type is an :class:`AFDConfigError`;
    2. makes that candidate the forward-context comm for the call;
    3. ``prepare_external(hidden, routing)`` -> prepared rows + aligned routing;
    4. runs the experts with the aligned routing;
    5. finalizes;
    6. restores the previous comm and releases the per-token state, whatever happened.
    """

    def __init__(
        self,
        candidates: Mapping[Hashable, ExternalRoutingComm],
        experts: ExpertsApply,
        slot: CommSlot,
        *,
        comm_type_of: Callable[[Any], Hashable | None] = _comm_type_attribute,
        reduce_results: bool = True,
        layer_name: str = "external-routing MoE",
    ) -> None:
        if not candidates:
            raise AFDConfigError(
                f"{layer_name}: no comm candidates for external routing; build the layer's "
                "AFD comm implementations at model initialisation"
            )
        self.candidates = dict(candidates)
        self.experts = experts
        self.slot = slot
        self.comm_type_of = comm_type_of
        self.reduce_results = reduce_results
        self.layer_name = layer_name

    def _unsupported(self, what: str) -> AFDConfigError:
        supported = sorted(str(t) for t in self.candidates)
        return AFDConfigError(
            f"{self.layer_name}: {what} is not supported with external routing "
            f"(supported comm types: {supported}); make the native selector pick one of "
            "them (e.g. disable fused MC2) or set compute_gate_on_attention=false"
        )

    def select_comm(self) -> ExternalRoutingComm:
        """The candidate matching the natively selected comm."""
        native = self.slot.comm_method
        if native is not None:
            comm_type = self.comm_type_of(native)
            if comm_type is None:
                raise self._unsupported(f"the selected MoE comm {type(native).__name__}")
        else:
            comm_type = self.slot.comm_type
            if comm_type is None:
                raise AFDConfigError(
                    f"{self.layer_name}: the forward context selects no MoE comm (neither an "
                    "instance nor a type); run the layer inside the platform's forward context"
                )
        candidate = self.candidates.get(comm_type)
        if candidate is None:
            raise self._unsupported(f"MoE comm type {comm_type}")
        return candidate

    def forward(self, hidden_states: torch.Tensor, routing: ExternalRouting) -> torch.Tensor:
        """The routed-experts output ``[rows, hidden]`` of ``hidden_states`` under ``routing``."""
        if routing.num_rows != hidden_states.shape[0]:
            raise AFDTransferMismatchError(
                f"{self.layer_name}: received routing for {routing.num_rows} tokens with "
                f"{hidden_states.shape[0]} hidden-state rows"
            )
        comm = self.select_comm()
        previous = self.slot.comm_method
        self.slot.comm_method = comm
        try:
            prepared, aligned = comm.prepare_finalize.prepare_external(hidden_states, routing)
            routed = self.experts.apply(prepared, aligned)
            return comm.finalize(
                routed,
                self.reduce_results,
                getattr(prepared, "padded_hidden_states_shape", None),
            )
        finally:
            try:
                self._release(comm)
            finally:
                self._restore(previous)

    __call__ = forward

    def _restore(self, previous: Any) -> None:
        self.slot.comm_method = previous

    def _release(self, comm: ExternalRoutingComm) -> None:
        try:
            self.experts.release()
        finally:
            release = getattr(comm.prepare_finalize, "release", None)
            if release is not None:
                release()


# -- a real single-rank implementation (TP=1, no DP) ----------------------------------
@dataclass(frozen=True, slots=True)
class LocalPrepared:
    """What :class:`LocalPrepareAndFinalize` prepares (the fields the experts read)."""

    hidden_states: torch.Tensor
    padded_hidden_states_shape: torch.Size | None


class LocalPrepareAndFinalize:
    """Prepare/finalize on one rank: rows stay in place, optionally zero-padded.

    ``padded_rows`` is the comm's fixed row count (MC2 pads every batch to the
    DP-wide token count); ``None`` pads nothing (all-gather with DP=1). Between
    prepare and finalize it remembers the token count; :meth:`release` forgets it.
    """

    def __init__(self, padded_rows: int | None = None) -> None:
        self.padded_rows = padded_rows
        self.num_tokens: int | None = None

    def prepare(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> _LocalPrepareOutput:
        rows = int(hidden_states.shape[0])
        target = rows if self.padded_rows is None else self.padded_rows
        if target < rows:
            raise AFDTransferMismatchError(
                f"{rows} tokens exceed the comm's {target} rows per batch"
            )
        self.num_tokens = rows
        pad = target - rows
        padded_shape = None
        if pad:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
            router_logits = torch.nn.functional.pad(router_logits, (0, 0, 0, pad))
            padded_shape = hidden_states.shape
        return _LocalPrepareOutput(hidden_states, router_logits, padded_shape)

    def prepare_external(
        self, hidden_states: torch.Tensor, routing: ExternalRouting
    ) -> tuple[LocalPrepared, ExternalRouting]:
        output, aligned = prepare_external_with(self.prepare, hidden_states, routing)
        return LocalPrepared(output.hidden_states, output.padded_hidden_states_shape), aligned

    def finalize(
        self,
        hidden_states: torch.Tensor,
        reduce_results: bool,
        padded_hidden_states_shape: torch.Size | None = None,
    ) -> torch.Tensor:
        if self.num_tokens is None:
            raise RuntimeError("finalize called without a matching prepare")
        # One rank: nothing to reduce whatever reduce_results says.
        return hidden_states[: self.num_tokens]

    def release(self) -> None:
        self.num_tokens = None


@dataclass(frozen=True, slots=True)
class _LocalPrepareOutput:
    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None
    padded_hidden_states_shape: torch.Size | None


class LocalExternalRoutingComm:
    """A single-rank comm candidate of type ``comm_type`` (:class:`LocalPrepareAndFinalize`)."""

    def __init__(self, comm_type: Hashable, padded_rows: int | None = None) -> None:
        self.comm_type = comm_type
        self.prepare_finalize = LocalPrepareAndFinalize(padded_rows)

    def finalize(
        self,
        hidden_states: torch.Tensor,
        reduce_results: bool,
        padded_hidden_states_shape: torch.Size | None = None,
    ) -> torch.Tensor:
        return self.prepare_finalize.finalize(
            hidden_states, reduce_results, padded_hidden_states_shape
        )


@dataclass
class LocalCommSlot:
    """A forward-context comm slot held in plain attributes."""

    comm_type: Hashable | None = None
    comm_method: Any = None


class RoutedExpertsApply:
    """vLLM's own routed experts (``RoutedExperts.forward_modular``) behind :class:`ExpertsApply`.

    The expert step of the single-rank flow off Ascend (on Ascend:
    ``afd_moe_runners.npu.ascend.AscendExpertsApply``). Sets no per-token state.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def apply(self, prepared: Any, routing: ExternalRouting) -> torch.Tensor:
        experts = self.runner.routed_experts
        # Private in vLLM 0.32 (see afd_moe_runners._vllm_compat), as in ffn_compute.
        experts._ensure_moe_quant_config_init()
        out = experts.forward_modular(
            x=prepared.hidden_states,
            topk_weights=routing.topk_weights,
            topk_ids=routing.topk_ids,
        )
        assert isinstance(out, torch.Tensor)
        return out

    def release(self) -> None:
        return None
