"""Job specs as YAML (``tail-ray submit job.yaml``): PyYAML's safe loader, plus floats
written without a dot.

The API takes numbers strictly (a string is never read as a number), so what YAML makes of
a scalar matters. PyYAML follows YAML 1.1, where ``1e-5`` is a *string* (1.1 wants
``1.0e-5``); YAML 1.2 and every JSON parser read it as a float. Resolving that form as a
float here keeps ``lr: 1e-5`` a valid spec. Integers, booleans and dotted floats resolve as
before; ``.nan`` and ``.inf`` stay floats, which the API rejects by name.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class JobSpecLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` / ``-2E+3`` (no dot) as floats."""


JobSpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_job_yaml(text: str) -> Any:
    return yaml.load(text, Loader=JobSpecLoader)  # a SafeLoader subclass: no arbitrary objects
