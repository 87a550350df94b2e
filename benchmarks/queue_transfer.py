"""Producer -> consumer through a Queue against the stdlib and torch: see arraymp/_bench.py.

The same as ``python -m arraymp bench [--quick] [--repeat N]``.
"""

import sys

from arraymp._bench import main

if __name__ == "__main__":
    sys.exit(main())
