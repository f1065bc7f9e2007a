"""Every exception lightspeed raises on purpose, importable from one place, under one base class:

.. code-block:: python

    from lightspeed.errors import LightspeedError, CollectiveTimeoutError

    try:
        trainer.fit(model, datamodule, ckpt_path="last")
    except CollectiveTimeoutError as hang:  # names the collective and the ranks that stopped answering or left
        ...

Each also derives from the built-in exception it always was (``ValueError``, ``RuntimeError`` or ``TypeError``).
A renamed class keeps its old name as a deprecated alias (``CallSiteMismatch``, now :class:`CallSiteMismatchError`):
the same class, reached with a ``FutureWarning``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# the classes and their one list of names (``__all__``) are core's: this module only hands them to users
from lightspeed.core.errors import *  # noqa: F403
from lightspeed.core.errors import __all__ as __all__

if not TYPE_CHECKING:  # the renamed classes' old names (a FutureWarning, then the class), at run time only
    from lightspeed.core.errors import __getattr__ as __getattr__
