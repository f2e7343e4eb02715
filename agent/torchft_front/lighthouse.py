"""torchft's lighthouse (``torchft._torchft.lighthouse_main``) without importing the
``torchft`` package, which imports torch: ``torchft_lighthouse`` takes as long to start as
torch does to import (seconds; 20-30 s on a loaded 2-core machine), this a fraction of a
second. Run as a script, ``python lighthouse.py FLAGS``: torchft reads the process's own
arguments past the first as its command line, so the script's path stands for the binary.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def lighthouse_main() -> object:
    spec = importlib.util.find_spec("torchft")  # finds the package, does not run it
    if spec is None or spec.origin is None:
        raise SystemExit("torchft is not installed: pip install 'marduk[torchft]'")
    where = os.path.dirname(spec.origin)
    names = [f for f in os.listdir(where) if f.startswith("_torchft.") and f.endswith(".so")]
    if not names:
        raise SystemExit(f"no torchft extension module in {where}")
    loader = importlib.machinery.ExtensionFileLoader(
        "torchft._torchft", os.path.join(where, names[0])
    )
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))  # type: ignore[arg-type]
    loader.exec_module(module)
    return module.lighthouse_main()


if __name__ == "__main__":
    sys.exit(lighthouse_main())  # type: ignore[arg-type]
