import sys

from shoal.operator.podtools.cli import main

sys.exit(main())
