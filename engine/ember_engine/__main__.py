import sys

from ember_engine.cli import main

sys.exit(main())
