import sys

from shoal.engine.gateway.cli import main

sys.exit(main())
