"""InternViT (InternVL's tower): not a family yet. What is missing, so the refusal says so."""

REFUSED = {
    "internvl_vision": "its layers scale the attention and MLP outputs (lambda_1, lambda_2), which megatron-core "
    "0.16.1's ViT layer specs cannot express, and InternVL feeds it through pixel shuffle into its own projector "
    "(InternVLForConditionalGeneration, not LLaVA)",
}
