"""What every converter and comparer worker imports, loaded once by their fork server
(cpu_ranks.start_fork_server): CPU workers compile no kernel and log nothing to W&B, so
megatron-core is imported without either (lean_import)."""

from megatron_ext.compat.lean_import import import_lean

import_lean(["megatron.core.dist_checkpointing", "megatron.core.models.multimodal.llava_model",
             "megatron_ext.distributed", "megatron_ext.model.provider"])
