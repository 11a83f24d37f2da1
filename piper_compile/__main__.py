import sys

from piper_compile.cli import main

sys.exit(main())
