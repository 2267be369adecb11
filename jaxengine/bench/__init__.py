"""Benchmarks: offline throughput and latency, load on a server, sweeps, and their figures."""
