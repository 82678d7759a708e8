"""Tracing (OpenTelemetry) and metrics (Ray's Prometheus export)."""
