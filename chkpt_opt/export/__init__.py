"""Exports for production trainers: per-layer settings and memory-viewer snapshots."""
