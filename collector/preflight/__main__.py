import sys

from ranklens.collector.preflight.runner import main

sys.exit(main())
