"""Benchmarks of the engine: ``python -m jaxengine.bench throughput|serve|latency|sweep``.

One module per mode (``throughput``, ``serve``, ``latency``, ``sweep``: each ``add_arguments``
and ``run(args) -> dict``), the request sources (``datasets``), the baselines
(``hf_baseline``, ``naive_baseline``), result files and tables (``report``) and figures (``plots``).
"""
