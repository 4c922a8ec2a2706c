import sys

from lmforge.cli import main

sys.exit(main())
