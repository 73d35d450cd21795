"""``python -m tta_bench``: the ``tta-bench`` command."""

from tta_bench.cli import main

raise SystemExit(main())
