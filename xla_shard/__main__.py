import sys

from xla_shard.cli import main

sys.exit(main())
