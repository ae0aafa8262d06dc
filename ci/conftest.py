"""Root conftest of the ``ci`` component: the tooling's tests get the project's marker registry too.

The registry's source is common/conftest.py. Model and recipe folders carry a synced copy of it as their conftest.py
(so a copied recipe stands alone); ci/ holds its copy as component_conftest.py and loads it as a plugin, because
ci/ has a root conftest of its own (this file).
"""

import sys
from pathlib import Path


# Importable whatever pytest's import mode or the working directory is.
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest_plugins = ["component_conftest"]
