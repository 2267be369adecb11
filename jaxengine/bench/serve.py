"""Serving benchmark: a client against a running OpenAI-compatible server (not in this build)."""
from __future__ import annotations


def add_arguments(parser) -> None:
    """No options: the mode is not in this build."""


def run(args) -> dict:
    raise RuntimeError("serve: the serving benchmark is not available in this build of jaxengine.bench")
