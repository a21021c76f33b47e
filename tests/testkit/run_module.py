"""``python -m MODULE ARGS`` inside this interpreter: the entry torchrun's ``--run-path`` runs in each rank when the
test kit has torchrun fork its ranks (tests.testkit.trainer_cli).

    torchrun ... --start-method fork --run-path /abs/path/run_module.py MODULE ARGS

``runpy.run_module`` with ``alter_sys`` gives the module what ``-m`` gives it: ``__name__ == "__main__"``, its file
as ``sys.argv[0]``, ARGS after it; the working directory stays first on ``sys.path``, as ``-m`` puts it.
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
