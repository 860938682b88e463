"""The default corpus: the text of Python's own documentation topics (``pydoc_data.topics``).

It ships with every CPython, so the default job needs no download. Topics are joined in sorted
key order so the text, and therefore the train/validation split, is identical everywhere.
"""

from __future__ import annotations

__all__ = ["default_corpus"]


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))
