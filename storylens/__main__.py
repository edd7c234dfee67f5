import sys

from storylens.cli import main

sys.exit(main())
