"""torch.compile of the forward pass: which mode, where its cache lives, falling back to eager
when compilation fails. (What ``--decode-executor`` means is each platform's: platforms/.)

``auto`` resolves per platform (``Platform.auto_compile_mode``) to what measured fastest
(docs/BENCHMARKS.md, "Compiled forward"): on CPU that is eager, because decode-only steps run Anna's fused C kernels, which
torch.compile cannot see into, and the compile itself costs tens of seconds per new shape class.
No GPU measurement has been made yet, so ``auto`` stays eager on CUDA and XPU too; ``default``,
``reduce-overhead`` and ``max-autotune`` ask for compilation explicitly.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

def use_inductor_cache_dir(path: str) -> str:
    """Point torch's compile cache at ``path`` (the resolved setting) for this process."""
    resolved = str(Path(path).expanduser())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = resolved
    return resolved


def first_line(exc: BaseException) -> str:
    """One line saying why a compile or a capture failed, for its single warning."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def keep_eager_parts(model: torch.nn.Module) -> None:
    """Leave the methods that a module names in its ``eager_under_compile`` to eager, on each
    instance. Done here, when a model is compiled, rather than by decorating them: the decorator
    imports torch._dynamo with the model's module, 2.5 s of every process's start on a 2-core CPU
    (each server, each tensor-parallel rank) that a model served eager never uses."""
    for module in model.modules():
        for name in getattr(module, "eager_under_compile", ()):
            setattr(module, name, torch.compiler.disable(getattr(module, name)))


class CompiledForward:
    """Calls the model's compiled forward; on the first failure, warns once and runs eager from then on."""

    def __init__(self, model: torch.nn.Module, mode: str, fullgraph: bool) -> None:
        keep_eager_parts(model)
        self.eager = model.forward
        self.mode = mode
        self.compiled: Callable[..., Any] | None = torch.compile(
            self.eager, mode=None if mode == "default" else mode, fullgraph=fullgraph, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                # Without duck sizing: two sizes that happen to be equal when a shape is first traced
                # (a decode batch of 3 whose block tables are 3 wide) would share one symbol, and the
                # next step where they differ would compile the same graph again.
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return self.compiled(*args)
            except Exception as exc:  # compilation (not the model) failed: serve eager instead
                log.warning("torch.compile (mode=%s) failed, running eager from now on: %s", self.mode,
                            first_line(exc))
                self.compiled = None
        return self.eager(*args)
