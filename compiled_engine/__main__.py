import sys

from compiled_engine.cli import main

sys.exit(main())
