"""``python -m fp4moe.reproduce [--rerun] [--no-train] [--slurm PROFILE] ...`` (fp4moe.reproduce.pipeline)."""
import sys

from .pipeline import main

sys.exit(main())
