"""``python -m fp4moe_kernels.bench``: this package holds several benchmarks; say which (exit status 2)."""
import sys

from . import __doc__ as _doc

print("fp4moe_kernels.bench is a package of benchmarks; run one of them:\n\n" + _doc.split("\n\n", 1)[1].split("\n\n")[0],
      file=sys.stderr)
sys.exit(2)
