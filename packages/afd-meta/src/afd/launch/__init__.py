"""``afd launch``: start a whole AFD deployment (FFN + Attention servers) on one machine.

A :class:`DeploymentSpec` says what to run (checkpoint, ``num_attention`` x
``num_ffn`` servers, gate placement, dtype, KV cache, extra vLLM args, ports, env,
log directory). It is built from keyword arguments, from the ``afd launch`` flags
or from a small TOML file (:meth:`DeploymentSpec.from_toml`)::

    model = "~/.cache/afd/tiny-deepseek_v2"
    num_attention = 2
    num_ffn = 1
    [afd]
    connect_timeout_s = 120

A :class:`Deployment` (a context manager) starts the FFN server(s), then the
Attention server(s), each as ``python -m afd.cli serve --role ...`` in its own
process group with a per-deployment ``TMPDIR``; it streams every role's output with
a prefix (``[ffn0] ``, ``[attn] ``) to the console and to ``<log_dir>/<role>.log``,
waits until every role's ``/health`` answers 200 (:mod:`afd.launch.readiness`), and
tears everything down (SIGTERM to every process group, SIGKILL after a grace
period, then a check that no process of the groups is left). A role that exits
during start-up raises :class:`DeploymentError` with its last log lines.

``DeploymentSpec(native=True)`` runs one plain vLLM OpenAI API server with the same
engine arguments instead: the baseline for ``afd demo`` and ``afd bench``.

Devices: on a host with visible CUDA devices ``[g0, g1, ...]`` (``CUDA_VISIBLE_DEVICES``,
else ``nvidia-smi -L``; nothing is imported for it) every role process gets its own:
the attention server (its DP ranks) ``g0..g(A-1)``, FFN rank ``f`` ``g(A+f)``, the native
baseline ``g0`` (:func:`assign_devices`). Per role, ``devices`` in ``[attention]`` /
``[ffn]`` or ``CUDA_VISIBLE_DEVICES`` in the role's ``env`` overrides it. See docs/gpu.md.

Same-host defaults: every role runs on this host, so the AFD connector defaults to the
shared-memory ``P2pShmAFDConnector`` (:data:`DEFAULT_CONNECTOR`; on a host with CUDA
devices the NCCL connector; ``[afd] connector`` overrides it). On a CPU host (no CUDA
device detected) each role process gets its own cores through
``VLLM_CPU_OMP_THREADS_BIND`` (:func:`split_cpus`: the attention server
the first half of the usable CPUs, rounded up, the FFN ranks one block each of the
rest; the native baseline all of them). Per role, ``cpus`` in ``[attention]`` /
``[ffn]`` or ``VLLM_CPU_OMP_THREADS_BIND`` in the role's ``env`` overrides it;
``VLLM_CPU_OMP_THREADS_BIND`` in the spec's top-level ``env`` or the launcher's
environment turns the automatic split off. See docs/cli.md.

The parts, one module each: :mod:`~afd.launch.spec` (the spec and its validation;
:mod:`~afd.launch.spec_afd` its AFD settings, parsed once into a typed ``AFDConfig``;
:mod:`~afd.launch.spec_file` reading and writing spec files; :mod:`~afd.launch.spec_roles`
the ``[attention]`` / ``[ffn]`` tables; :mod:`~afd.launch.checks` the checks of single
values),
:mod:`~afd.launch.ports` (port allocation), :mod:`~afd.launch.devices` and
:mod:`~afd.launch.cpus` (CUDA devices / CPUs per role; :mod:`~afd.launch.placement`
plans them for a spec), :mod:`~afd.launch.commands` (the role processes' commands),
:mod:`~afd.launch.processes` (starting, watching and stopping a role process),
:mod:`~afd.launch.readiness` (when a role is ready), :mod:`~afd.launch.deployment`
(the orchestration) and :mod:`~afd.launch.cli` (``afd launch``).

Beyond one host: a spec with a ``[ray]`` table (or ``afd launch --ray [ADDRESS]``) runs
the same role processes as Ray actors (:mod:`~afd.launch.ray`, :class:`RayDeployment`;
Ray is the ``afd[ray]`` extra, imported only then), each asking for its role's resources
in one placement group (:func:`plan_ray`), with a guard per role
(:mod:`~afd.launch.guard`) that stops it if its actor dies.
"""

from __future__ import annotations

from afd.launch.cli import (
    add_cpu_arguments,
    add_launch_arguments,
    forward_signals,
    run_launch,
    spec_from_args,
)
from afd.launch.cpus import (
    CPU_BIND,
    assign_cpus,
    bind_affinity,
    format_cpu_list,
    omp_bind_env,
    parse_cpu_list,
    split_cpus,
    usable_cpus,
)
from afd.launch.deployment import Deployment
from afd.launch.devices import (
    CUDA_VISIBLE_DEVICES,
    assign_devices,
    detect_cuda_devices,
    parse_nvidia_smi_list,
    parse_visible_devices,
)
from afd.launch.errors import (
    DeploymentError,
    SpecError,
)
from afd.launch.placement import (
    NodeInfo,
    RayBundle,
    RayPlan,
    plan_node_cpus,
    plan_ray,
)
from afd.launch.ports import (
    allocate_health_ports,
    allocate_ports,
    reserve_ports,
)
from afd.launch.processes import (
    MAX_TMPDIR_LEN,
    TAIL_LINES,
    RoleProcess,
    prefix_lines,
    role_env,
    role_tmp_dir,
)
from afd.launch.ray import RayDeployment, RayRoleProcess, import_ray
from afd.launch.readiness import (
    RoleReadiness,
    readiness_of,
)
from afd.launch.spec import (
    DEFAULT_CONNECTOR,
    DEFAULT_CUDA_CONNECTOR,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_NETWORK_CONNECTOR,
    RAY_PLACEMENTS,
    DeploymentSpec,
    RayResources,
    RaySpec,
    RoleOverrides,
    load_toml,
)

__all__ = [
    "CPU_BIND",
    "CUDA_VISIBLE_DEVICES",
    "DEFAULT_CONNECTOR",
    "DEFAULT_CUDA_CONNECTOR",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_NETWORK_CONNECTOR",
    "Deployment",
    "DeploymentError",
    "DeploymentSpec",
    "MAX_TMPDIR_LEN",
    "NodeInfo",
    "RAY_PLACEMENTS",
    "RayBundle",
    "RayDeployment",
    "RayPlan",
    "RayResources",
    "RayRoleProcess",
    "RaySpec",
    "RoleOverrides",
    "RoleProcess",
    "RoleReadiness",
    "SpecError",
    "TAIL_LINES",
    "add_cpu_arguments",
    "add_launch_arguments",
    "allocate_health_ports",
    "allocate_ports",
    "assign_cpus",
    "assign_devices",
    "bind_affinity",
    "detect_cuda_devices",
    "format_cpu_list",
    "forward_signals",
    "import_ray",
    "load_toml",
    "omp_bind_env",
    "parse_cpu_list",
    "parse_nvidia_smi_list",
    "parse_visible_devices",
    "plan_node_cpus",
    "plan_ray",
    "prefix_lines",
    "readiness_of",
    "reserve_ports",
    "role_env",
    "role_tmp_dir",
    "run_launch",
    "spec_from_args",
    "split_cpus",
    "usable_cpus",
]
