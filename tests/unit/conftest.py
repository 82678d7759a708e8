"""Fixtures of the unit tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's real tokenizer and chat template (ChatML-like), built locally in
    well under a second; no weights, no torch. The class is the one AutoTokenizer picks
    for it (importing AutoTokenizer costs seconds more)."""
    from transformers import PreTrainedTokenizerFast

    from engines.tiny_model import generate_tiny_tokenizer

    path: Path = generate_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
    return PreTrainedTokenizerFast.from_pretrained(path)
