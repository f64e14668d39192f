"""Benchmarks (side by side with the peer, JSON output). Thin wrappers live in scripts/bench_*.py."""
