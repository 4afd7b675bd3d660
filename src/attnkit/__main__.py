import sys

from attnkit.tools.cli import main

sys.exit(main())
