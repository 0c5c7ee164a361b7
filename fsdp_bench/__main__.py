"""`python -m fsdp_bench`: the same command as `fsdp-bench`."""

import sys

from fsdp_bench.cli import main

sys.exit(main())
