"""The user's own modules that a config names (a training method's class, reward functions, tools): imported only
where the config names them, with the config's directory searched first."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ..errors import first_line


def import_user_module(module_name: str, where: str, config_dir: str | Path | None, error: type[Exception],
                       missing_hint: str = ""):
    """The module, or `error` with one line starting with `where`. `missing_hint` follows the line for a module
    that is not there ("; put x.py next to the config file ...")."""
    # The config's directory is on sys.path only while the module imports: left there, a later import of any name
    # that matches a file beside the config (wandb.py, ray.py) would run code the config never named.
    added = config_dir is not None and str(config_dir) not in sys.path
    if added:
        sys.path.insert(0, str(config_dir))
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            searched = f"{config_dir} (the config's directory) and sys.path" if config_dir is not None else "sys.path"
            hint = missing_hint.format(top=exc.name.split(".")[0])
            raise error(f"{where}: no module named '{exc.name}' (looked in {searched}){hint}") from None
        raise error(f"{where}: module '{module_name}' cannot be imported: {first_line(exc)}") from None
    except Exception as exc:  # SyntaxError, an ImportError of its own, anything its top level raises
        raise error(f"{where}: module '{module_name}' cannot be imported: {type(exc).__name__}: "
                    f"{first_line(exc)}") from None
    finally:
        if added:
            sys.path.remove(str(config_dir))
