"""hypothesis strategies the tests share: JSON documents of a given shape."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_documents(
    leaves: st.SearchStrategy[Any],
    keys: st.SearchStrategy[str],
    *,
    list_size: int,
    object_size: int,
    max_leaves: int,
) -> st.SearchStrategy[Any]:
    """JSON values built of ``leaves`` in lists of at most ``list_size`` items and objects
    of at most ``object_size`` members named by ``keys``, nested."""

    # a named function, not a lambda: hypothesis reads a lambda's source, which fails if the
    # file changes during the run and then warns, an error here
    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.lists(children, max_size=list_size) | st.dictionaries(
            keys, children, max_size=object_size
        )

    return st.recursive(leaves, containers, max_leaves=max_leaves)
