"""Import a user's .py file (reward function, agent) as a module, or raise one clear error."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

from rlrun.runtime.errors import RlrunError

_module_counter = itertools.count()


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line: multi-line tracebacks from user code would break the one-line error contract."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_file(path_text: str, kind: str, error: type[RlrunError], defines: str) -> ModuleType:
    """Import `path_text` under a unique module name. kind: "reward file"; defines: what the file must
    define, for the messages."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise error(
            f"{kind} {path_text} does not exist (resolved to {path.resolve()}); "
            f"pass the path of a .py file that defines {defines}."
        )
    # A unique name keeps two files (or a reload) from clobbering each other in sys.modules.
    name = f"rlrun_{kind.replace(' ', '_')}_{next(_module_counter)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    if spec is None or spec.loader is None:
        raise error(f"{kind} {path_text} cannot be loaded as a Python module; make sure it is a plain .py source file.")
    module = importlib.util.module_from_spec(spec)
    # Registered before exec because dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if not isinstance(exc, Exception):
            raise
        raise error(
            f"{kind} {path_text} failed to import: {one_line(exc)}; fix the file (try: python {path_text})."
        ) from exc
    return module
