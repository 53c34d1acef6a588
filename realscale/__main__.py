import sys

from realscale.cli import main

sys.exit(main())
