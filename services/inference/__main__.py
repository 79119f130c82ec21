"""``python -m services.inference``: run the inference service.

OpenMP's spin-wait is bounded before torch (and with it libgomp, which reads the variable once
as it loads) is imported: a thread that reaches a barrier first spins at most
``GOMP_SPINCOUNT`` iterations, then sleeps. Unbounded (libgomp's default is 300,000 spins
between every parallel region, of which a decode step has hundreds) the torch threads spin
while the gateway, the tokenizer or a neighbour holds the other core, and a 64-stream run on
the 2-core VM fell from ~840 to 23-59 tokens/s in some runs; bounded at 20,000 it held 823-842
and lost nothing on a quiet machine, while a passive wait (no spinning) cost 25-30%
(docs/engine.md, "Threads under contention"; decision 53). A value set in the environment wins.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from services.inference.server import main  # noqa: E402  (after the OpenMP setting, on purpose)

if __name__ == "__main__":
    main()
