"""Root conftest of the ``ci`` component: the tooling's tests get the project's marker registry too.

Model and recipe folders carry a synced copy of component_conftest.py as their conftest.py (so a copied recipe
stands alone); ci/ never leaves the repository, so it loads the original as a plugin instead of a copy.
"""

import sys
from pathlib import Path


# Importable whatever pytest's import mode or the working directory is.
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest_plugins = ["component_conftest"]
