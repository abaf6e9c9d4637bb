"""Model specs: ``package.module:function`` or ``path/to/file.py:function``.

The function takes no arguments (``max-batch`` passes ``batch=``) and returns
``(model, example_args)`` or ``(model, example_args, example_kwargs)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chkpt_opt.errors import TraceError

logger = logging.getLogger(__name__)


def builder(module_name: str, func_name: str) -> Callable[..., Any]:
    """The function ``func_name`` of a module name or a ``.py`` file, not yet called."""
    spec = f"{module_name}:{func_name}"
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise TraceError(f"model file {module_name!r} does not exist.")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise TraceError(f"cannot import {module_name!r}.")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except TraceError:
        raise
    except Exception as err:
        raise TraceError(f"cannot import {module_name!r} for model spec {spec!r}: {err}") from err
    found = getattr(module, func_name, None)
    if not callable(found):
        raise TraceError(f"{module_name!r} has no function {func_name!r} (model spec {spec!r}).")
    return found


def normalize_built(spec: str, built: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """A builder's return value as ``(model, args tuple, kwargs dict)``."""
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TraceError(
            f"{spec} returned {type(built).__name__}; it must return (model, example_args) or "
            "(model, example_args, example_kwargs)."
        )
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else {}
    return model, tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(kwargs or {})


def call_builder(spec: str, make: Callable[..., Any], **kwargs: Any) -> Any:
    """``make(**kwargs)``, the model function of ``spec``, with what it raises as a TraceError.

    The error is one line (the spec, the exception's type and the first line of its message,
    what to check); the traceback is logged, so ``chkpt-opt -v`` shows it.

    Raises:
        TraceError: when the function raises.
    """
    try:
        return make(**kwargs)
    except Exception as err:
        logger.info("model spec %s raised:", spec, exc_info=True)
        lines = str(err).strip().splitlines()
        message = f": {lines[0]}" if lines else ""
        call = f"{spec.rpartition(':')[2]}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise TraceError(
            f"model spec {spec!r} failed: {call} raised {type(err).__name__}{message}; check "
            f"that {call} runs on its own and returns (model, example_args[, example_kwargs]) "
            "(run with -v for the traceback)."
        ) from err


def load_model_spec(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Imports ``package.module:function`` (or ``file.py:function``) and calls it.

    Raises:
        TraceError: when the spec is malformed, cannot be imported, its function raises, or
            it returns something else.
    """
    if ":" not in spec:
        raise TraceError(
            f"model spec {spec!r} must be package.module:function or path/to/file.py:function, "
            "e.g. chkpt_opt.zoo:gpt."
        )
    module_name, _, func_name = spec.rpartition(":")
    return normalize_built(spec, call_builder(spec, builder(module_name, func_name)))
