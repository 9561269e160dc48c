import sys

from adaptive_eager.cli import main

sys.exit(main())
