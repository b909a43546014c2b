"""`python -m deploy COMMAND ...` is `kvserve COMMAND ...`, for machines where the project runs
from its tree without console scripts (the bare GPU machine of bench/gpu_run.sh)."""

from deploy.cli import kvserve_main

kvserve_main()
