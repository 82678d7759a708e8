"""The ``kvtide`` command line: up, demo, doctor, inspect, plan, key."""

from orchestrator.cli.main import main

__all__ = ["main"]
