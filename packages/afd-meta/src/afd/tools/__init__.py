"""Developer tools of afd: what runs *around* a deployment, never inside vLLM.

* :mod:`afd.tools.client`: the one OpenAI-compatible completion client (greedy
  completions, streamed timing) used by the demo, the bench, the tests and ``tools/``;
* :mod:`afd.tools.demo`: ``afd demo`` (AFD against native vLLM, token by token);
* :mod:`afd.tools.bench`: ``afd bench`` (AFD against native vLLM, throughput and
  latency), with :mod:`afd.tools.bench_metrics` (role counters per level);
* :mod:`afd.tools.profile`: ``afd bench --profile`` reports (step timelines);
* :mod:`afd.tools.reference`: native vLLM greedy references
  (``python -m afd.reference``, kept as the entry point of this module);
* :mod:`afd.tools.models`: locally generated tiny checkpoints (``afd models tiny``) and
  ``afd models check``.

The runtime (plugin, serve, workers, FFN server) never imports this package. Importing
it imports nothing heavy: each module imports torch / vLLM inside the functions that
need them.
"""
