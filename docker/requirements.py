"""Print Packfeed's requirements from pyproject.toml, one per line: its build requirements, its runtime
dependencies and the named extras. The images install these in a layer of their own, before the source is
copied, so that a source change rebuilds in seconds. Usage: python3 requirements.py [EXTRA ...]"""

import sys
import tomllib

with open("pyproject.toml", "rb") as file:
    pyproject = tomllib.load(file)
extras = pyproject["project"].get("optional-dependencies", {})
unknown = [name for name in sys.argv[1:] if name not in extras]
if unknown:
    sys.exit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(extras)}")
print("\n".join(pyproject["build-system"]["requires"] + pyproject["project"]["dependencies"]
                + [r for name in sys.argv[1:] for r in extras[name]]))
