"""The one way storylens runs a module in evaluation mode: :func:`eval_mode`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``with eval_mode(model):`` the module (dropout off) in evaluation mode inside the block, and
    back in the mode it was in afterwards, even after an exception."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
