"""``python -m tta_bench.cli``: the ``tta-bench`` command."""

import sys

from tta_bench.cli.commands import main

sys.exit(main())
