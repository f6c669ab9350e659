"""``python tests/train/cli.py [overrides]``: ``python -m fp4moe.train`` with the tests' byte-level data
(byte_data.install) in place of fp4moe.data, for end-to-end tests in a subprocess."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import byte_data  # noqa: E402

byte_data.install()

from fp4moe.train.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
