"""Old spellings keep working: a moved name or a renamed keyword gives what it gave, with a FutureWarning that names
the new spelling and points at the user's line."""

from __future__ import annotations

import pytest

from lightspeed.core.common.deprecation import moved_attribute, renamed_keyword

MOVED = {"Old": ("new.place.New", 42)}


def __getattr__(name: str) -> object:  # this module stands for a public module that lost a name
    return moved_attribute(__name__, name, MOVED)


def _owner(new: int = 0, old: int | None = None) -> int:
    return renamed_keyword("owner", "old", "new", old, new, 0)


def test_a_moved_name_reaches_its_object_with_a_warning_at_the_users_line() -> None:
    import sys

    module = sys.modules[__name__]
    with pytest.warns(
        FutureWarning,
        match=rf"^{__name__}\.Old is deprecated and will be removed; use new\.place\.New "
        r"instead\.$",
    ) as caught:
        assert module.Old == 42
    assert caught[0].filename == __file__
    with pytest.raises(AttributeError, match=rf"module '{__name__}' has no attribute 'Other'"):
        module.Other  # noqa: B018


def test_a_renamed_keyword_takes_the_old_name_with_a_warning() -> None:
    assert _owner(3) == 3
    with pytest.warns(
        FutureWarning, match=r"^owner\(old=\.\.\.\) is deprecated .*; use new=\.\.\. instead\.$"
    ) as caught:
        assert _owner(old=5) == 5
    assert caught[0].filename == __file__
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match=r"owner got new=1 and its deprecated name old=2"):
        _owner(1, old=2)
