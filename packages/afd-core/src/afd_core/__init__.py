"""Typed contracts for Attention-FFN Disaggregation.

Configuration, topology, transfer payloads, connector interface and registry,
forward-context metadata, weight-role classification; the testing kit lives in
:mod:`afd_core.testing`. Imports neither torch nor vLLM.
"""

from afd_core._version import __version__
from afd_core.config import ADDITIONAL_CONFIG_KEY, AFDConfig, AFDRole, RoutingPayload
from afd_core.connector import AFDConnector, ConnectorCapabilities, FFNBatch
from afd_core.errors import (
    AFDAdmissionError,
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDError,
    AFDFingerprintMismatchError,
    AFDMetadataMissingError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
    UnknownConnectorError,
)
from afd_core.forward_context import (
    AFD_CONTEXT_KEY,
    AFDStepMetadata,
    MicroBatchScheduler,
    find_step_metadata,
    get_step_metadata,
    set_step_metadata,
)
from afd_core.registry import (
    ENTRY_POINT_GROUP,
    available_connectors,
    create_connector,
    get_connector_class,
    register_connector,
)
from afd_core.topology import AFDTopology
from afd_core.transfer import (
    AttentionToFFN,
    FFNToAttention,
    PayloadKind,
    TensorLike,
    TransferHeader,
)
from afd_core.weights import RoleWeightStats, WeightOwner, filter_role_weights

__all__ = [
    "__version__",
    # config / topology
    "ADDITIONAL_CONFIG_KEY",
    "AFDConfig",
    "AFDRole",
    "RoutingPayload",
    "AFDTopology",
    # wire contracts and connectors
    "AttentionToFFN",
    "ConnectorCapabilities",
    "FFNToAttention",
    "PayloadKind",
    "TensorLike",
    "TransferHeader",
    "AFDConnector",
    "FFNBatch",
    "ENTRY_POINT_GROUP",
    "available_connectors",
    "create_connector",
    "get_connector_class",
    "register_connector",
    # forward context
    "AFD_CONTEXT_KEY",
    "AFDStepMetadata",
    "MicroBatchScheduler",
    "find_step_metadata",
    "get_step_metadata",
    "set_step_metadata",
    # weights
    "RoleWeightStats",
    "WeightOwner",
    "filter_role_weights",
    # errors
    "AFDError",
    "AFDAdmissionError",
    "AFDConfigError",
    "AFDFingerprintMismatchError",
    "AFDConnectorError",
    "AFDConnectorClosedError",
    "AFDMetadataMissingError",
    "AFDPeerLostError",
    "AFDTimeoutError",
    "AFDTransferMismatchError",
    "UnknownConnectorError",
]
