"""Tooling beside the runtime: the end-to-end demo, the GPU check, the benchmarks and the house plan
(``python -m bert_ds.devtools.house``). Nothing in the training runtime imports from here."""
