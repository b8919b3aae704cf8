"""Errors shared by dspark's model loaders."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names the file and what is wrong with it.

    A ``ValueError`` subclass so that callers treating bad input generically still catch it.
    """
