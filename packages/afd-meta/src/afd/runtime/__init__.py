"""The runtime room of afd: what runs inside the role processes.

* :mod:`afd.runtime.plugin` -- vLLM's general plugin (``vllm.general_plugins``
  entry point ``afd = afd.runtime.plugin:register``): the ``AFD<Arch>`` aliases, the
  AFD worker table;
* :mod:`afd.runtime.serve` -- ``afd serve --role {attention,ffn}``: parses the AFD
  section once at the edge and hands it to vLLM in canonical keys;
* :mod:`afd.runtime.worker` -- the Attention role's micro-batching workers
  (``--worker-cls``) and their table;
* :mod:`afd.runtime.ffn_server` -- the headless FFN server and its worker extension;
* :mod:`afd.runtime.health` -- ``/health`` and ``/metrics`` of the FFN server;
* :mod:`afd.runtime.environment` -- checks of the Python environment;
* :mod:`afd.runtime.opaque_ffn` -- the compiled-mode reference's FFN-behind-op model.

The other rooms: :mod:`afd.launch` (``afd launch``: processes, placement, Ray) and the
tools (bench, profile, demo, reference, models).
"""
