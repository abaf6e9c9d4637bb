"""Benchmarks for researchers: solver sweeps over the corpus, reports, and batch-size search."""
