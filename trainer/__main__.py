"""`torchrun --nproc-per-node N -m packfeed.trainer --config train.yaml [section.key=value ...]`"""

from packfeed.trainer.train import main

raise SystemExit(main())
