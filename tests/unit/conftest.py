"""Fixtures of the unit tier."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# As the ingress of the embedded default runs (``orchestrator.serve.app.ingress_options``:
# the tiny model's tool calls are sampled by the tools' JSON schema), set before any
# test imports vLLM's tool parsers (vLLM reads it once, at import).
os.environ.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's real tokenizer and chat template (ChatML-like), built locally in
    well under a second; no weights, no torch. The class is the one AutoTokenizer picks
    for it (importing AutoTokenizer costs seconds more)."""
    from transformers import PreTrainedTokenizerFast

    from engines.tiny_model import generate_tiny_tokenizer

    path: Path = generate_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
    return PreTrainedTokenizerFast.from_pretrained(path)
