"""``python -m structlm.cli`` (what ``torchrun -m structlm.cli train ...`` runs)."""

import sys

from structlm.cli import main

sys.exit(main())
