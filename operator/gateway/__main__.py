import sys

from shoal.operator.gateway.cli import main

sys.exit(main())
