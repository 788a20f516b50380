"""How the model's layers run on their devices: the choices that shape its TransformerConfigs but
not its weights. The trainer resolves them from its options (`config.execution_choices`) and hands this one
object to `provider.ModelOptions`; inference builds keep the defaults. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelExecution:
    attention_backend: str = "auto"  # te | sdpa | local; auto: te when usable, else sdpa (backends.py)
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel size
    fp8: str | None = None  # FP8 recipe: Transformer Engine's format ("hybrid"), or torchao's ("tensorwise")
    fp8_backend: str = "te"  # what runs it: te | torchao (`model/float8_linears.py`)
    recompute_granularity: str | None = None  # None | "selective" (core attention) | "full" (whole layers)
    recompute_method: str = "uniform"  # full recomputation: "uniform" or "block"
    recompute_num_layers: int = 1
    gradient_accumulation_fusion: bool = False  # weight gradients accumulated in place (training on GPU)
    logits_where_loss: bool = False  # training: output layer and cross entropy only where a loss is taken
    compile_layers: bool = False  # each transformer layer compiled by torch.compile (`compiled_layers`)
    vision_attention: str = "sdpa"  # a native-resolution tower's attention (`tower_attention.CHOICES`)

