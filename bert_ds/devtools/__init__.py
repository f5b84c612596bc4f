"""Tooling beside the runtime: the end-to-end demo, the GPU check and the benchmarks. Nothing in the training
runtime imports from here."""
