import sys

from fleetcuda.cli import main

sys.exit(main())
