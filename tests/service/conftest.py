from __future__ import annotations

import os
import sys
from pathlib import Path

# Ray reads its auth mode when it is first imported; say token auth before any test imports it.
os.environ["RAY_AUTH_MODE"] = "token"
# service_support sits next to this file; make it importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).parent))
