"""What patches megatron-core and torch, or quiets them: production code only, each patch saying the
failure it fixes."""
