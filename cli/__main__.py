import sys

from compiled_engine.apps.cli import main

sys.exit(main())
