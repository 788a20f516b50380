"""Does our trainer train the model transformers would? See megatron_ext/commands/parity.py.

    python scripts/train/check_parity.py --hf-dir HF --data-path DATA --steps 3 --stage 2 [-g 2 --tp 2]
"""

from megatron_ext.commands.parity import main

if __name__ == "__main__":
    main()
