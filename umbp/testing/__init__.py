"""Helpers shared by the demo, the benchmarks and the integration tests: tiny
random-weight models written locally (no model hub) and engine drivers."""
