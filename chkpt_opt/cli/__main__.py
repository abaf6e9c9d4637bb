"""``python -m chkpt_opt.cli``: the same as the ``chkpt-opt`` console script."""

import sys

from chkpt_opt.cli.entry import main

sys.exit(main())
