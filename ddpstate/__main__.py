import sys

from ddpstate.cli import main

sys.exit(main())
