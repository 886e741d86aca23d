from __future__ import annotations

import sys
from pathlib import Path

# pytest runs in importlib mode, which does not put test folders on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
