import sys

from latentspeed.cli import main

sys.exit(main())
