"""`python -m diloco_node` is the same as the `diloco-node` command."""

import sys

from diloco_node.cli import main

sys.exit(main())
