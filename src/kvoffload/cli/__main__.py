import sys

from kvoffload.cli.main import main

sys.exit(main())
