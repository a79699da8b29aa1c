"""End-to-end serving comparison of hetserve against llama.cpp's llama-server and HF transformers.

Modules: `llama_build` (build llama-server once from the llama-cpp-python sdist), `servers` (the
configurations, start/stop on a free port, peak RSS of the process tree), `drive` (the workloads,
sent through `hetserve loadgen`, and the metrics read back), `hf` (the transformers baseline, in
its own process), `report` (table, JSON, plot). Entry point: `python -m benchmarks.e2e_peers`.
"""
