"""Recipe fixtures. The recipe folder goes first on ``sys.path``, so tests import its flat modules (``dataset``,
``datamodule``, ...) exactly as the entrypoints do, also when pytest starts from another directory."""

import sys
from pathlib import Path


RECIPE_DIR = Path(__file__).resolve().parent.parent
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))
