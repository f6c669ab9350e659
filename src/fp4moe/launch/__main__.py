"""``python -m fp4moe.launch dry-run experiment=... [overrides] [--summary] [--scripts] [--strict]``
(fp4moe.launch.dry_run)."""
import sys

from .dry_run import main

sys.exit(main())
