"""Reference kernels, one family per sub-package.

Importing this package imports every sub-package, which registers its implementations with
``conformance.register``, exactly as a third-party module would: a family's kernels join by being a
package here, and nothing else names them.
"""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__, f"{__name__}."):
    if _info.ispkg:
        importlib.import_module(_info.name)
del _info
