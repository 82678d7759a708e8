"""``python -m kernels {validate,show,diff,compile}``."""

from kernels.cli import main

raise SystemExit(main())
