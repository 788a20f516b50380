"""An HTML page of a training run from its own records (see megatron_ext/pages/run_report.py).

    python scripts/train/report.py SAVE_DIR [--output page.html] [--png]
"""

from megatron_ext.commands.train import report
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(report)
